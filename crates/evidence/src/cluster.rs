//! A private PostgreSQL cluster with `pg_stat_statements` preloaded, made from the machine's
//! PostgreSQL binaries, stopped and removed when dropped.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::AnyError;

/// A running private cluster.
#[derive(Debug)]
pub(crate) struct Cluster {
    bin: PathBuf,
    dir: PathBuf,
    port: u16,
    as_postgres: bool,
}

fn bin_dir() -> Result<PathBuf, AnyError> {
    if let Ok(out) = Command::new("pg_config").arg("--bindir").output()
        && out.status.success()
    {
        let p = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        if p.join("initdb").exists() {
            return Ok(p);
        }
    }
    let mut found: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let v: u32 = e.file_name().to_string_lossy().parse().ok()?;
            let bin = e.path().join("bin");
            bin.join("initdb").exists().then_some((v, bin))
        })
        .collect();
    found.sort();
    found.pop().map(|(_, p)| p).ok_or_else(|| {
        "no PostgreSQL server binaries (initdb) found: install postgresql, or pass --database-url \
         of a server with pg_stat_statements in shared_preload_libraries"
            .into()
    })
}

fn free_port() -> Result<u16, AnyError> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

impl Cluster {
    /// initdb into a fresh directory and start the server on a free loopback port. PostgreSQL
    /// refuses to run as root, so under root the server runs as the `postgres` user.
    pub(crate) async fn start() -> Result<Cluster, AnyError> {
        let bin = bin_dir()?;
        let as_postgres = is_root();
        let dir = std::env::temp_dir().join(format!("nexuscrm-evidence-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)?;
        if as_postgres {
            let status = Command::new("chown")
                .args(["-R", "postgres:postgres"])
                .arg(&dir)
                .status()?;
            if !status.success() {
                return Err(format!("cannot chown {} to postgres", dir.display()).into());
            }
        }
        let port = free_port()?;
        let cluster = Cluster {
            bin,
            dir,
            port,
            as_postgres,
        };
        let data = cluster.dir.join("data");
        cluster.run(
            "initdb",
            &[
                "-D",
                &data.to_string_lossy(),
                "-U",
                "postgres",
                "-A",
                "trust",
                "-E",
                "UTF8",
                "--no-sync",
            ],
        )?;
        let log = cluster.dir.join("server.log");
        let options = format!(
            "-p {port} -k {} -c listen_addresses=127.0.0.1 \
             -c shared_preload_libraries=pg_stat_statements -c pg_stat_statements.track=all \
             -c pg_stat_statements.max=10000 -c max_connections=200",
            cluster.dir.display()
        );
        cluster.run(
            "pg_ctl",
            &[
                "-D",
                &data.to_string_lossy(),
                "-l",
                &log.to_string_lossy(),
                "-o",
                &options,
                "-w",
                "-t",
                "60",
                "start",
            ],
        )?;
        let deadline = Instant::now() + Duration::from_secs(30);
        while !cluster.ready() {
            if Instant::now() > deadline {
                return Err(
                    format!("the private cluster did not start; see {}", log.display()).into(),
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Ok(cluster)
    }

    fn command(&self, tool: &str) -> Command {
        let path = self.bin.join(tool);
        if self.as_postgres {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(path);
            c
        } else {
            Command::new(path)
        }
    }

    fn run(&self, tool: &str, args: &[&str]) -> Result<(), AnyError> {
        let out = self
            .command(tool)
            .args(args)
            .current_dir(&self.dir)
            .stdin(Stdio::null())
            .output()
            .map_err(|e| format!("cannot run {tool}: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "{tool} failed: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            )
            .into());
        }
        Ok(())
    }

    fn ready(&self) -> bool {
        std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok()
    }

    /// The URL of database `db` as `user`.
    pub(crate) fn url(&self, user: &str, db: &str) -> String {
        format!("postgres://{user}@127.0.0.1:{}/{db}", self.port)
    }

    /// The data directory (for messages).
    pub(crate) fn dir(&self) -> &Path {
        &self.dir
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let data = self.dir.join("data");
        let _ = self
            .command("pg_ctl")
            .args([
                "-D",
                &data.to_string_lossy(),
                "-m",
                "immediate",
                "-w",
                "stop",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

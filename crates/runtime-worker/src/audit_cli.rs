//! `audit …`: read the audit trail the worker delivered to its JSON Lines file (and its
//! rotated files), and what the outbox still holds.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Subcommand;
use nexuscrm_audit::{JsonlSink, Line, read_lines};

use crate::AnyError;
use crate::config::Settings;

/// The `audit` subcommands.
#[derive(Subcommand, Debug)]
pub(crate) enum AuditCommand {
    /// The last events in the audit file (`audit.file`, default nexuscrm-audit.jsonl), oldest
    /// first, read across its rotated files.
    Tail {
        /// Only events about this subject (a record key, a schedule, a paused step).
        #[arg(long)]
        subject: Option<String>,
        /// How many events.
        #[arg(long, short = 'n', default_value_t = 20)]
        lines: usize,
        /// Another audit file than the configured one.
        #[arg(long)]
        file: Option<PathBuf>,
        /// Print the JSON lines as they are in the file.
        #[arg(long)]
        json: bool,
    },
    /// Events committed and not yet delivered, and the oldest one's age (from the database).
    Pending,
}

/// `n` as a UTC time of day with milliseconds (the file keeps epoch milliseconds).
fn clock(ms: i64) -> String {
    let secs = ms.div_euclid(1000);
    let day = secs.rem_euclid(86_400);
    format!(
        "{:02}:{:02}:{:02}.{:03}Z",
        day / 3600,
        day / 60 % 60,
        day % 60,
        ms.rem_euclid(1000)
    )
}

/// One event as a line of text: time, kind, subject, actor, event id, body (cut to 120
/// bytes: record data is user input, and a terminal is not the place for all of it).
pub(crate) fn format_line(l: &Line) -> String {
    let body = l.body.to_string();
    format!(
        "{} {:<16} {:<24} {:<10} {} {}",
        clock(l.at_ms),
        l.kind,
        l.subject,
        l.actor,
        l.event_id,
        crate::echo(&body, 120)
    )
}

/// The last `n` events of `sink` (about `subject`, when given), oldest first.
pub(crate) fn tail(sink: &JsonlSink, subject: Option<&str>, n: usize) -> Result<Vec<Line>, String> {
    let mut lines = read_lines(sink)
        .map_err(|e| format!("cannot read the audit file {}: {e}", sink.path().display()))?;
    if let Some(s) = subject {
        lines.retain(|l| l.subject == s);
    }
    let skip = lines.len().saturating_sub(n);
    Ok(lines.split_off(skip))
}

pub(crate) async fn audit_command(
    settings: &Settings,
    command: AuditCommand,
) -> Result<ExitCode, AnyError> {
    match command {
        AuditCommand::Tail {
            subject,
            lines,
            file,
            json,
        } => {
            let sink = match file {
                Some(f) => JsonlSink::new(f).keep(settings.audit.keep),
                None => {
                    if let Some(http) = &settings.audit.http {
                        return Err(format!(
                            "the audit trail goes to the HTTP receiver {} (`audit.sink = \"http\"`): \
                             read it there, or pass --file for a JSON Lines file",
                            http.url()
                        )
                        .into());
                    }
                    settings.audit.sink()
                }
            };
            if !sink.path().exists() {
                return Err(format!(
                    "no audit file at {} (the worker writes it once it delivers events; \
                     see `audit.file`)",
                    sink.path().display()
                )
                .into());
            }
            let found = tail(&sink, subject.as_deref(), lines)?;
            if found.is_empty() {
                eprintln!(
                    "no audit events{}",
                    match &subject {
                        Some(s) => format!(" about {s:?}"),
                        None => String::new(),
                    }
                );
            }
            for l in &found {
                if json {
                    println!("{}", serde_json::to_string(l)?);
                } else {
                    println!("{}", format_line(l));
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        AuditCommand::Pending => {
            let db = nexuscrm_persistence::Db::connect(&settings.database_url).await?;
            nexuscrm_audit::migrate(&db).await?;
            let audit = nexuscrm_audit::Audit::without_migrations(
                db,
                crate::supervise::audit_options(settings),
            );
            let o = audit.observations().await?;
            let age = o
                .oldest_undelivered
                .and_then(|t| std::time::SystemTime::now().duration_since(t).ok());
            println!(
                "undelivered: {}  oldest: {}",
                o.undelivered,
                age.map_or("-".into(), |d| format!("{:.1?} ago", d))
            );
            Ok(ExitCode::SUCCESS)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(seq: i64, subject: &str) -> Line {
        Line {
            seq,
            event_id: format!("e{seq}"),
            subject: subject.into(),
            kind: "record.applied".into(),
            actor: "bulk".into(),
            at_ms: 1_700_000_000_123 + seq,
            body: serde_json::json!({"n": seq, "note": "<b>x</b>"}),
        }
    }

    #[test]
    fn tail_keeps_the_last_events_of_a_subject_across_rotated_files() {
        let dir = std::env::temp_dir().join(format!(
            "nexuscrm-audit-tail-{}-{}",
            std::process::id(),
            nexuscrm_persistence::support::new_token()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let sink = JsonlSink::new(dir.join("a.jsonl")).keep(2);
        let write = |path: PathBuf, lines: &[Line]| {
            let text: String = lines
                .iter()
                .map(|l| serde_json::to_string(l).unwrap() + "\n")
                .collect();
            std::fs::write(path, text).unwrap();
        };
        write(sink.rotated(1), &[line(1, "a"), line(2, "b"), line(3, "a")]);
        write(sink.path().to_path_buf(), &[line(4, "b"), line(5, "a")]);
        let seqs = |v: Vec<Line>| v.iter().map(|l| l.seq).collect::<Vec<_>>();
        assert_eq!(seqs(tail(&sink, None, 3).unwrap()), vec![3, 4, 5]);
        assert_eq!(seqs(tail(&sink, Some("a"), 2).unwrap()), vec![3, 5]);
        assert_eq!(seqs(tail(&sink, Some("a"), 10).unwrap()), vec![1, 3, 5]);
        assert!(tail(&sink, Some("zzz"), 10).unwrap().is_empty());
        std::fs::write(sink.path(), "not json\n").unwrap();
        let e = tail(&sink, None, 3).unwrap_err();
        assert!(e.contains("not an audit event line"), "{e}");
        let text = format_line(&line(7, "acct-1"));
        assert!(text.starts_with("22:13:20.130Z record.applied"), "{text}");
        assert!(text.contains("acct-1") && text.contains("e7"), "{text}");
    }
}

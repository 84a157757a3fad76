//! The architecture boundary (contract slice 1), checked over `cargo metadata`:
//!
//! - `nexuscrm-worker` depends on `tokio` and `tokio-util` only (plus the optional, off by
//!   default `tracing` feature);
//! - no family crate depends on another family crate; a family that derives from another's
//!   records depends on the records domain (`nexuscrm-records`), which depends on persistence
//!   only; persistence depends on no family or domain;
//! - the audit outbox (whose `record` families call in their transactions) depends on no
//!   family or domain;
//! - telemetry depends on no family, domain, outbox or persistence (usage reaches it through
//!   the process's hooks);
//! - production code (controller, persistence, families, the process) never depends on the
//!   conformance kit outside `[dev-dependencies]`;
//! - every workspace member is classified here, so a new crate must say what it is.

use std::collections::BTreeMap;
use std::process::Command;

use serde_json::Value;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    Controller,
    Kit,
    Persistence,
    /// A canonical domain's read path (the records Bulk writes), which families may depend
    /// on instead of on the family that writes it; it depends on persistence only.
    Domain,
    Family,
    /// A family whose write API other families call inside their own transactions (the audit
    /// outbox); it depends on persistence and the controller only, never on a family.
    Outbox,
    Process,
    /// Best-effort telemetry: families' usage reaches it through the process's hooks, so it
    /// depends on the controller only, never on a family, domain or persistence.
    Telemetry,
    /// A measurement tool run by hand and in CI, never deployed (it reuses the kit's counting
    /// wrapper on purpose).
    Tool,
}

fn role(name: &str) -> Option<Role> {
    Some(match name {
        "nexuscrm-worker" => Role::Controller,
        "nexuscrm-worker-test" => Role::Kit,
        "nexuscrm-persistence" => Role::Persistence,
        "nexuscrm-records" => Role::Domain,
        "nexuscrm-bulk" | "nexuscrm-flow" | "nexuscrm-paused" | "nexuscrm-formula" => Role::Family,
        "nexuscrm-audit" => Role::Outbox,
        "nexuscrm-telemetry" => Role::Telemetry,
        "nexuscrm-runtime-worker" => Role::Process,
        "nexuscrm-evidence" | "nexuscrm-chaos" => Role::Tool,
        _ => return None,
    })
}

/// Every violation in a `cargo metadata --no-deps` document.
fn violations(metadata: &Value) -> Vec<String> {
    let mut out = Vec::new();
    let packages = metadata["packages"].as_array().cloned().unwrap_or_default();
    let roles: BTreeMap<String, Option<Role>> = packages
        .iter()
        .filter_map(|p| p["name"].as_str())
        .map(|n| (n.to_owned(), role(n)))
        .collect();
    for p in &packages {
        let name = p["name"].as_str().unwrap_or("?");
        let Some(me) = roles.get(name).copied().flatten() else {
            out.push(format!("{name} is not classified in tests/architecture.rs"));
            continue;
        };
        for d in p["dependencies"].as_array().into_iter().flatten() {
            let dep = d["name"].as_str().unwrap_or("?");
            // `kind` is null for normal dependencies, "build" or "dev" otherwise.
            let kind = d["kind"].as_str().unwrap_or("normal");
            if kind == "dev" {
                continue;
            }
            let optional = d["optional"].as_bool().unwrap_or(false);
            let theirs = roles.get(dep).copied().flatten();
            if me == Role::Controller {
                let allowed =
                    matches!(dep, "tokio" | "tokio-util") || (dep == "tracing" && optional);
                if !allowed {
                    out.push(format!(
                        "nexuscrm-worker depends on `{dep}` ({kind}): only tokio and tokio-util \
                         are allowed (tracing only as an optional feature)"
                    ));
                }
            }
            if me == Role::Family && theirs == Some(Role::Family) {
                out.push(format!("family {name} depends on family {dep}"));
            }
            if me == Role::Persistence && matches!(theirs, Some(Role::Family | Role::Domain)) {
                out.push(format!("persistence depends on {dep}"));
            }
            if me == Role::Outbox
                && matches!(theirs, Some(Role::Family | Role::Domain | Role::Outbox))
            {
                out.push(format!("outbox {name} depends on {dep}"));
            }
            if me == Role::Telemetry
                && matches!(
                    theirs,
                    Some(Role::Family | Role::Domain | Role::Outbox | Role::Persistence)
                )
            {
                out.push(format!("telemetry {name} depends on {dep}"));
            }
            if me == Role::Domain && matches!(theirs, Some(Role::Family | Role::Domain)) {
                out.push(format!("domain {name} depends on {dep}"));
            }
            let production = matches!(
                me,
                Role::Controller
                    | Role::Persistence
                    | Role::Domain
                    | Role::Family
                    | Role::Outbox
                    | Role::Telemetry
                    | Role::Process
            );
            if production && theirs == Some(Role::Kit) {
                out.push(format!(
                    "production crate {name} depends on the test kit {dep} ({kind}); use \
                     [dev-dependencies]"
                ));
            }
        }
        if me == Role::Controller {
            let default = &p["features"]["default"];
            if default.as_array().is_some_and(|f| !f.is_empty()) {
                out.push(format!(
                    "nexuscrm-worker enables default features {default}"
                ));
            }
        }
    }
    out
}

#[test]
fn the_workspace_keeps_its_architecture_boundary() {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");
    let out = Command::new(env!("CARGO"))
        .args([
            "metadata",
            "--format-version",
            "1",
            "--no-deps",
            "--offline",
        ])
        .current_dir(root)
        .output()
        .expect("cargo metadata runs");
    assert!(
        out.status.success(),
        "cargo metadata failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let metadata: Value = serde_json::from_slice(&out.stdout).unwrap();
    let names: Vec<&str> = metadata["packages"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|p| p["name"].as_str())
        .collect();
    assert!(names.contains(&"nexuscrm-worker") && names.contains(&"nexuscrm-bulk"));
    let v = violations(&metadata);
    assert!(
        v.is_empty(),
        "architecture boundary broken:\n{}",
        v.join("\n")
    );
}

fn package(name: &str, deps: &[(&str, Option<&str>, bool)]) -> Value {
    let deps: Vec<Value> = deps
        .iter()
        .map(|(n, kind, optional)| serde_json::json!({"name": n, "kind": kind, "optional": optional}))
        .collect();
    serde_json::json!({"name": name, "dependencies": deps, "features": {}})
}

#[test]
fn each_kind_of_boundary_break_is_caught() {
    let cases = [
        (
            package(
                "nexuscrm-worker",
                &[("tokio", None, false), ("sqlx", None, false)],
            ),
            "only tokio and tokio-util",
        ),
        (
            package("nexuscrm-worker", &[("tracing", None, false)]),
            "only tokio and tokio-util",
        ),
        (
            package("nexuscrm-flow", &[("nexuscrm-bulk", None, false)]),
            "family nexuscrm-flow depends on family nexuscrm-bulk",
        ),
        (
            package("nexuscrm-persistence", &[("nexuscrm-flow", None, false)]),
            "persistence depends on nexuscrm-flow",
        ),
        (
            package("nexuscrm-formula", &[("nexuscrm-bulk", None, false)]),
            "family nexuscrm-formula depends on family nexuscrm-bulk",
        ),
        (
            package("nexuscrm-records", &[("nexuscrm-bulk", None, false)]),
            "domain nexuscrm-records depends on nexuscrm-bulk",
        ),
        (
            package("nexuscrm-persistence", &[("nexuscrm-records", None, false)]),
            "persistence depends on nexuscrm-records",
        ),
        (
            package(
                "nexuscrm-runtime-worker",
                &[("nexuscrm-worker-test", None, false)],
            ),
            "depends on the test kit",
        ),
        (
            package(
                "nexuscrm-bulk",
                &[("nexuscrm-worker-test", Some("build"), false)],
            ),
            "depends on the test kit",
        ),
        (package("nexuscrm-newfamily", &[]), "is not classified"),
    ];
    for (pkg, want) in cases {
        let names = [
            "nexuscrm-bulk",
            "nexuscrm-flow",
            "nexuscrm-formula",
            "nexuscrm-records",
            "nexuscrm-worker-test",
        ];
        let mut packages: Vec<Value> = names
            .iter()
            .filter(|n| **n != pkg["name"])
            .map(|n| package(n, &[]))
            .collect();
        packages.push(pkg.clone());
        let v = violations(&serde_json::json!({ "packages": packages }));
        assert!(
            v.iter().any(|m| m.contains(want)),
            "{pkg}: want {want:?}, got {v:?}"
        );
    }
    // Allowed: the optional tracing feature, the kit as a dev-dependency, and a family that
    // reads the records domain (and uses the family that writes it only in its tests).
    let ok = [
        package(
            "nexuscrm-worker",
            &[
                ("tokio", None, false),
                ("tokio-util", None, false),
                ("tracing", None, true),
            ],
        ),
        package(
            "nexuscrm-bulk",
            &[("nexuscrm-worker-test", Some("dev"), false)],
        ),
        package("nexuscrm-worker-test", &[]),
        package(
            "nexuscrm-formula",
            &[
                ("nexuscrm-records", None, false),
                ("nexuscrm-bulk", Some("dev"), false),
            ],
        ),
        package("nexuscrm-records", &[("nexuscrm-persistence", None, false)]),
        package("nexuscrm-persistence", &[]),
    ];
    assert_eq!(
        violations(&serde_json::json!({ "packages": ok })),
        Vec::<String>::new()
    );
}

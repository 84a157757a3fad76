//! The registry of asynchronous paths: every family this process can run, with its
//! declaration (what an acknowledgement promises), the crate that owns it, and where that
//! promise is proven (the test functions, and on which backends).
//!
//! Start-up refuses a controller whose family is not here or whose declaration differs from
//! the registered one ([`check_started`]), and a unit test fails if an entry names a proof
//! test that does not exist, so the table `families` prints cannot drift from what runs or
//! from what is proven.

use nexuscrm_worker::Declaration;
use serde_json::{Value, json};

/// One proof of a path's declaration: test functions in one file.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Proof {
    /// The test file, relative to the workspace root.
    pub(crate) file: &'static str,
    /// The test functions in `file` that carry the proof.
    pub(crate) tests: &'static [&'static str],
    /// What they prove.
    pub(crate) what: &'static str,
    /// The backends they run on.
    pub(crate) backends: &'static str,
}

/// One asynchronous path.
#[derive(Debug, Clone)]
pub(crate) struct Path {
    /// The family's declaration, the constant its crate exports.
    pub(crate) declaration: Declaration,
    /// The crate that owns the family (its only claim path).
    pub(crate) owner: &'static str,
    /// Where the declaration is proven.
    pub(crate) proofs: &'static [Proof],
}

const ALL_BACKENDS: &str = "SQLite, PostgreSQL, MariaDB";
const WITH_GALERA: &str = "SQLite, PostgreSQL, MariaDB, Galera";

/// The kit's conformance scenarios in `file`, one test per backend (each family's
/// `tests/scenarios.rs` names them alike).
const fn kit_scenarios(file: &'static str) -> Proof {
    Proof {
        file,
        tests: &[
            "conformance_scenarios_pass_on_sqlite",
            "conformance_scenarios_pass_on_postgres",
            "conformance_scenarios_pass_on_mysql",
        ],
        what: "the kit's conformance scenarios",
        backends: ALL_BACKENDS,
    }
}

/// Where `bulk` is proven.
const BULK_PROOFS: &[Proof] = &[
    Proof {
        file: "crates/bulk/tests/crash_matrix.rs",
        tests: &[
            "bulk_sqlite_crash_matrix",
            "bulk_postgres_crash_matrix",
            "bulk_mysql_crash_matrix",
            "bulk_galera_crash_matrix",
        ],
        what: "the crash matrix: every row applied exactly once after a crash at every point",
        backends: WITH_GALERA,
    },
    kit_scenarios("crates/bulk/tests/scenarios.rs"),
    Proof {
        file: "crates/bulk/tests/audit.rs",
        tests: &["bulk_applied_rows_are_audited_and_delivered_once_in_order"],
        what: "each applied row's audit event commits with it and reaches the file once, in revision order",
        backends: ALL_BACKENDS,
    },
    Proof {
        file: "crates/bulk/tests/galera.rs",
        tests: &["four_workers_over_three_galera_nodes_apply_every_row_exactly_once"],
        what: "4 workers over 3 Galera nodes",
        backends: "Galera",
    },
];

/// Where `flow` is proven.
const FLOW_PROOFS: &[Proof] = &[
    Proof {
        file: "crates/flow/tests/crash_matrix.rs",
        tests: &[
            "flow_sqlite_crash_matrix",
            "flow_postgres_crash_matrix",
            "flow_mysql_crash_matrix",
            "flow_galera_crash_matrix",
        ],
        what: "the crash matrix: each occurrence reserved once, none missed",
        backends: WITH_GALERA,
    },
    kit_scenarios("crates/flow/tests/scenarios.rs"),
    Proof {
        file: "crates/flow/tests/galera_node_loss.rs",
        tests: &["a_node_killed_mid_run_misses_no_occurrence_and_reserves_none_twice"],
        what: "a Galera node killed mid-run",
        backends: "Galera",
    },
];

/// Where `paused` is proven.
const PAUSED_PROOFS: &[Proof] = &[
    Proof {
        file: "crates/paused/tests/crash_matrix.rs",
        tests: &[
            "paused_sqlite_crash_matrix",
            "paused_postgres_crash_matrix",
            "paused_mysql_crash_matrix",
            "paused_galera_crash_matrix",
        ],
        what: "the crash matrix with outcome-uncertain quarantine",
        backends: WITH_GALERA,
    },
    kit_scenarios("crates/paused/tests/scenarios.rs"),
    Proof {
        file: "crates/paused/tests/load.rs",
        tests: &[
            "four_workers_deliver_each_effect_once_on_sqlite",
            "four_workers_deliver_each_effect_once_on_postgres",
            "four_workers_deliver_each_effect_once_on_mysql",
            "four_workers_over_three_galera_nodes_deliver_each_effect_once",
        ],
        what: "4 workers, each effect once",
        backends: WITH_GALERA,
    },
];

/// Where `formula` is proven.
const FORMULA_PROOFS: &[Proof] = &[
    Proof {
        file: "crates/formula/tests/convergence.rs",
        tests: &[
            "a_fresh_worker_converges_after_a_crash_at_every_point",
            "random_interleavings_with_crashes_converge_to_canonical_state",
            "four_replicas_converge_one_burst_with_the_last_revision_winning",
        ],
        what: "the kit's convergence harness; random interleavings with crashes; 4 replicas converge one burst",
        backends: ALL_BACKENDS,
    },
    Proof {
        file: "crates/formula/tests/formula.rs",
        tests: &[
            "reconciliation_repairs_exactly_the_rows_edited_by_hand",
            "the_rollup_sweep_repairs_accounts_on_every_side_of_its_chunk_boundaries",
            "a_sweep_chunk_costs_a_bounded_number_of_statements",
            "an_idle_postgres_view_issues_no_statements_between_changes",
        ],
        what: "hand edits repaired exactly, bounded sweep chunks, no idle statements",
        backends: ALL_BACKENDS,
    },
];

/// Where `audit` is proven.
const AUDIT_PROOFS: &[Proof] = &[
    Proof {
        file: "crates/audit/tests/audit.rs",
        tests: &[
            "events_commit_with_their_change_and_are_delivered_once_in_subject_order",
            "a_crash_at_every_point_delivers_every_event_exactly_once_after_recovery",
            "a_torn_last_line_is_truncated_and_its_events_delivered_once",
            "the_file_rotates_by_size_and_no_event_is_lost_or_repeated_across_files",
        ],
        what: "the outbox commits with its change; a crash at every point, a torn line and rotation leave each event in the file exactly once",
        backends: ALL_BACKENDS,
    },
    Proof {
        file: "crates/audit/tests/audit.rs",
        tests: &[
            "four_replicas_deliver_every_event_once_in_subject_order_after_two_crashed_holders",
            "a_live_replica_taking_delivery_back_from_a_crashed_one_reads_the_tail_again",
            "a_sink_that_is_down_loses_nothing_and_gets_every_event_when_it_returns",
        ],
        what: "4 replicas deliver 100,000 events (CI: 3,000) once, in subject order, after two crashed holders; a sink that is down loses nothing",
        backends: ALL_BACKENDS,
    },
    Proof {
        file: "crates/bulk/tests/crash_matrix.rs",
        tests: &[
            "bulk_sqlite_crash_matrix",
            "bulk_postgres_crash_matrix",
            "bulk_mysql_crash_matrix",
        ],
        what: "Bulk's crash matrix: after every crash the audit trail and the change log agree one to one",
        backends: ALL_BACKENDS,
    },
    Proof {
        file: "crates/audit/tests/audit.rs",
        tests: &[
            "the_http_sink_resends_an_ambiguous_batch_under_its_key_and_delivers_each_event_once",
            "the_http_sink_delivers_every_event_once_after_a_crash_at_every_point",
            "a_receiver_that_is_down_gets_everything_when_it_returns_and_a_rejection_stops_delivery",
        ],
        what: "the HTTP sink against a local deduplicating receiver: lost answers resent under the batch's key, a crash at every point, a receiver down then back, a permanent rejection stopping delivery with its reason; each event received once, in subject order",
        backends: ALL_BACKENDS,
    },
    Proof {
        file: "crates/runtime-worker/tests/process.rs",
        tests: &["the_audit_trail_goes_to_an_http_receiver_when_configured"],
        what: "the Runtime Worker with `audit.sink = \"http\"` delivers Bulk's trail to a local receiver",
        backends: "SQLite",
    },
    Proof {
        file: "crates/audit/tests/audit.rs",
        tests: &[
            "an_ownership_takeover_writes_one_event_in_its_transaction_and_a_refused_one_none",
        ],
        what: "operator decisions: an ownership takeover writes its event in its transaction, a refused or rolled-back one none",
        backends: ALL_BACKENDS,
    },
    Proof {
        file: "crates/flow/tests/flow.rs",
        tests: &[
            "every_schedule_change_writes_one_audit_event_in_its_transaction_and_no_op_changes_none",
        ],
        what: "operator decisions: each schedule change writes one event with its actor, a no-op or refused change none",
        backends: ALL_BACKENDS,
    },
    Proof {
        file: "crates/paused/tests/worker.rs",
        tests: &["an_ambiguous_effect_is_quarantined_never_resent_until_a_person_retries"],
        what: "operator decisions: a committed pause resolution writes one event with its evidence, a refused one none",
        backends: ALL_BACKENDS,
    },
    Proof {
        file: "crates/runtime-worker/tests/process.rs",
        tests: &["a_newer_generation_takes_over_and_the_older_one_exits_superseded"],
        what: "the cutover fence: a newer generation's takeover writes one ownership.taken per family naming the one it replaced",
        backends: "PostgreSQL",
    },
];

/// Where `telemetry` is proven.
const TELEMETRY_PROOFS: &[Proof] = &[
    Proof {
        file: "crates/telemetry/tests/telemetry.rs",
        tests: &[
            "telemetry_passes_the_kits_loss_harness_against_a_local_otlp_receiver",
            "events_reach_the_receiver_as_otlp_log_records_with_their_attributes",
            "a_full_buffer_drops_and_counts_overflow_and_shutdown_counts_what_was_left",
            "without_an_exporter_every_event_is_counted_as_dropped_and_bad_endpoints_are_refused",
        ],
        what: "the kit's loss harness (clean, a failing receiver, a crash before and after a batch) against a local OTLP/HTTP receiver: every event exported or counted dropped, never reported complete; overflow, shutdown and no-exporter drops counted",
        backends: "in memory, OTLP/HTTP",
    },
    Proof {
        file: "crates/telemetry/tests/telemetry.rs",
        tests: &["a_hung_exporter_never_delays_a_bulk_segment"],
        what: "a hung exporter never delays a Bulk job's segments",
        backends: ALL_BACKENDS,
    },
    Proof {
        file: "crates/runtime-worker/tests/process.rs",
        tests: &["usage_events_reach_a_local_otlp_receiver_and_drops_are_counted_by_reason"],
        what: "the Runtime Worker exports Bulk's usage to a local OTLP/HTTP receiver; /metrics and /snapshot count drops by reason",
        backends: "SQLite",
    },
];

/// Every path the Runtime Worker runs, in start-up order.
pub(crate) fn paths() -> Vec<Path> {
    vec![
        Path {
            declaration: nexuscrm_bulk::DECLARATION,
            owner: "nexuscrm-bulk",
            proofs: BULK_PROOFS,
        },
        Path {
            declaration: nexuscrm_flow::DECLARATION,
            owner: "nexuscrm-flow",
            proofs: FLOW_PROOFS,
        },
        Path {
            declaration: nexuscrm_paused::DECLARATION,
            owner: "nexuscrm-paused",
            proofs: PAUSED_PROOFS,
        },
        Path {
            declaration: nexuscrm_formula::DECLARATION,
            owner: "nexuscrm-formula",
            proofs: FORMULA_PROOFS,
        },
        Path {
            declaration: nexuscrm_audit::DECLARATION,
            owner: "nexuscrm-audit",
            proofs: AUDIT_PROOFS,
        },
        Path {
            declaration: nexuscrm_telemetry::DECLARATION,
            owner: "nexuscrm-telemetry",
            proofs: TELEMETRY_PROOFS,
        },
    ]
}

/// The registered path of `family`, if any.
pub(crate) fn lookup(family: &str) -> Option<Path> {
    paths()
        .into_iter()
        .find(|p| p.declaration.family() == family)
}

/// Refuses to start when a controller's family is not registered, or is registered with
/// another declaration: every path this process runs must be in the table it prints.
pub(crate) fn check_started<'a>(
    started: impl IntoIterator<Item = &'a Declaration>,
) -> Result<(), String> {
    for d in started {
        match lookup(d.family()) {
            None => {
                return Err(format!(
                    "family {:?} ({d}) is not in the registry of asynchronous paths \
                     (crates/runtime-worker/src/registry.rs); register it with its proof",
                    d.family()
                ));
            }
            Some(p) if p.declaration != *d => {
                return Err(format!(
                    "family {:?} starts as {d} but is registered as {}",
                    d.family(),
                    p.declaration
                ));
            }
            Some(_) => {}
        }
    }
    Ok(())
}

/// The registry as JSON (`/families`), each path marked with whether this process runs it.
pub(crate) fn json(running: &[&str]) -> Value {
    let paths: Vec<Value> = paths()
        .iter()
        .map(|p| {
            json!({
                "family": p.declaration.family(),
                "declaration": p.declaration.to_string(),
                "durability": p.declaration.durability().to_string(),
                "effect": p.declaration.effect().to_string(),
                "owner": p.owner,
                "running": running.contains(&p.declaration.family()),
                "proofs": p.proofs.iter().map(|f| json!({
                    "file": f.file,
                    "tests": f.tests,
                    "what": f.what,
                    "backends": f.backends,
                })).collect::<Vec<_>>(),
            })
        })
        .collect();
    json!({ "paths": paths })
}

/// The registry as the text table `families` prints.
pub(crate) fn table() -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<8} {:<48} {:<17} proof",
        "family", "declaration", "owner"
    );
    for p in paths() {
        let mut first = true;
        for f in p.proofs {
            let (family, decl, owner) = if first {
                (
                    p.declaration.family().to_owned(),
                    p.declaration.to_string(),
                    p.owner,
                )
            } else {
                (String::new(), String::new(), "")
            };
            first = false;
            let _ = writeln!(
                out,
                "{family:<8} {decl:<48} {owner:<17} {} ({} test{}; {}): {}",
                f.file,
                f.tests.len(),
                if f.tests.len() == 1 { "" } else { "s" },
                f.backends,
                f.what
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_proof_the_registry_names_is_a_test_that_exists() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        for p in paths() {
            assert!(!p.proofs.is_empty(), "{} has no proof", p.declaration);
            for f in p.proofs {
                let text = std::fs::read_to_string(root.join(f.file)).unwrap_or_else(|e| {
                    panic!("{}: {} cannot be read: {e}", p.declaration, f.file)
                });
                for test in f.tests {
                    let defined = [format!("fn {test}()"), format!("async fn {test}()")]
                        .iter()
                        .any(|sig| text.contains(sig.as_str()));
                    assert!(
                        defined,
                        "{}: {} has no test `{test}`",
                        p.declaration, f.file
                    );
                }
            }
        }
    }

    #[test]
    fn each_family_is_registered_once_with_its_crates_own_declaration() {
        let all = paths();
        let mut names: Vec<&str> = all.iter().map(|p| p.declaration.family()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), all.len(), "a family is registered twice");
        check_started(all.iter().map(|p| &p.declaration)).unwrap();
    }

    #[test]
    fn an_unregistered_or_redeclared_family_is_refused_at_start() {
        use nexuscrm_worker::{Durability, Effect};
        let stranger =
            Declaration::new_const("stranger", Durability::BestEffort, Effect::LossTolerant);
        let err = check_started([&stranger]).unwrap_err();
        assert!(err.contains("not in the registry"), "{err}");
        let liar = Declaration::new_const("bulk", Durability::BestEffort, Effect::LossTolerant);
        let err = check_started([&nexuscrm_bulk::DECLARATION, &liar]).unwrap_err();
        assert!(err.contains("registered as"), "{err}");
    }

    #[test]
    fn the_table_and_the_json_list_every_path() {
        let table = table();
        let json = json(&["bulk"]);
        for p in paths() {
            assert!(table.contains(&p.declaration.to_string()), "{table}");
        }
        let listed = json["paths"].as_array().unwrap();
        assert_eq!(listed.len(), paths().len());
        assert_eq!(listed[0]["running"], true);
        assert_eq!(listed[1]["running"], false);
    }
}

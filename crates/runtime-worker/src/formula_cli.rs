//! `formula …`: define, list and drop Formula View definitions, show a record's derived values
//! with the revision they came from, and print the account roll-up.

use std::process::ExitCode;

use clap::Subcommand;
use nexuscrm_formula::{Formula, FormulaOptions, RecordView};
use nexuscrm_persistence::Db;
use serde_json::Value;

use crate::{AnyError, json_arg};

/// The `formula` subcommands.
#[derive(Subcommand, Debug)]
pub(crate) enum FormulaCommand {
    /// Define (or redefine) a formula field as a CEL expression over `record` (the record's
    /// fields), `key` and `revision`; refused with the parser's message and position when it
    /// does not compile. Every record is rederived in the background by a running worker.
    Define {
        /// The formula's name (letters, digits and `_`, starting with a letter).
        name: String,
        /// The CEL expression, for example 'record.amount * record.probability / 100'.
        #[arg(long)]
        expr: String,
        /// A sample record's fields, as JSON: the expression must evaluate on it.
        #[arg(long)]
        sample: Option<String>,
    },
    /// Every definition with its version.
    List,
    /// Drop a formula: its values leave the view as records are rederived.
    Drop {
        /// The formula's name.
        name: String,
    },
    /// A record's derived values, each with the record revision and definition version it
    /// came from.
    Show {
        /// The record key.
        key: String,
    },
    /// The account roll-up: the sum of each account's open opportunity amounts.
    Rollup {
        /// How many accounts.
        #[arg(long, default_value_t = 20)]
        limit: i64,
    },
}

/// Opens the records domain (Bulk's migrations) and the Formula View over `url`.
pub(crate) async fn open_formula(db: Db) -> Result<Formula, AnyError> {
    // The view reads the records domain's tables: they must exist first.
    nexuscrm_bulk::Bulk::open(db.clone(), 1, nexuscrm_bulk::BulkOptions::default()).await?;
    Ok(Formula::open(db, FormulaOptions::default()).await?)
}

pub(crate) async fn formula_command(
    url: &str,
    command: FormulaCommand,
) -> Result<ExitCode, AnyError> {
    let formula = open_formula(Db::connect(url).await?).await?;
    match command {
        FormulaCommand::Define { name, expr, sample } => {
            let sample = sample.map(|s| json_arg("sample", &s)).transpose()?;
            let d = formula.define(&name, &expr, sample.as_ref()).await?;
            if d.changed {
                println!(
                    "defined {} (version {}); a running worker rederives every record",
                    d.definition.name, d.definition.version
                );
            } else {
                println!(
                    "{} already has this expression (version {}): nothing changed",
                    d.definition.name, d.definition.version
                );
            }
        }
        FormulaCommand::List => {
            let defs = formula.list().await?;
            if defs.is_empty() {
                println!("no formulas defined");
            }
            println!("{:<24} {:>8}  expression", "name", "version");
            for d in defs {
                println!("{:<24} {:>8}  {}", d.name, d.version, d.expression);
            }
        }
        FormulaCommand::Drop { name } => {
            let version = formula.drop_definition(&name).await?;
            println!("dropped {name} (version {version})");
        }
        FormulaCommand::Show { key } => {
            let Some(view) = formula.show(&key).await? else {
                return Err(format!(
                    "record {:?} has no entry in the view (no such record, or not derived yet)",
                    crate::echo(&key, 120)
                )
                .into());
            };
            print_view(&key, &view);
        }
        FormulaCommand::Rollup { limit } => {
            if !(1..=10_000).contains(&limit) {
                return Err(format!("--limit {limit} must be 1 to 10000").into());
            }
            print_rollups(&formula.rollups(limit).await?);
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// One value as the CLI prints it: its JSON text, or the record's error.
fn shown(value: Option<&Value>, error: Option<&str>) -> String {
    match (value, error) {
        (_, Some(e)) => format!("error: {e}"),
        (Some(v), None) => v.to_string(),
        (None, None) => "null".into(),
    }
}

/// Prints a record's view entry.
pub(crate) fn print_view(key: &str, view: &RecordView) {
    let revision = if view.source_revision < 0 {
        "never derived".to_owned()
    } else {
        format!("revision {}", view.source_revision)
    };
    println!(
        "record {key}: {revision}{}",
        if view.stale {
            " (stale: rederivation pending)"
        } else {
            ""
        }
    );
    for v in &view.values {
        println!(
            "  {:<20} = {:<28} (from revision {}, definition version {})",
            v.formula,
            shown(v.value.as_ref(), v.error.as_deref()),
            v.source_revision,
            v.definition_version
        );
    }
}

/// Prints roll-up rows.
pub(crate) fn print_rollups(rollups: &[nexuscrm_formula::Rollup]) {
    println!("{:<24} {:>14} {:>8}", "account", "open amount", "records");
    for r in rollups {
        println!("{:<24} {:>14} {:>8}", r.account, r.total, r.records);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_error_value_is_shown_as_the_error_never_as_null() {
        assert_eq!(
            shown(None, Some("division by zero")),
            "error: division by zero"
        );
        assert_eq!(shown(Some(&serde_json::json!(12)), None), "12");
        assert_eq!(shown(Some(&serde_json::json!("a")), None), "\"a\"");
        assert_eq!(shown(None, None), "null");
    }
}

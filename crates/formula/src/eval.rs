//! CEL expressions over a record, the roll-up's contribution, and the digest that makes a
//! hand-edited view row visible to reconciliation.

use std::collections::HashMap;
use std::sync::Arc;

use cel::{Context, ExecutionError, Program, Value as Cel};
use serde_json::Value;

/// The variables an expression may name: `record` (the record's fields as a map), `key` (its
/// key) and `revision` (its revision).
pub const VARIABLES: [&str; 3] = ["record", "key", "revision"];

/// The functions an expression may call beyond CEL's operators (the interpreter's standard
/// library).
pub const FUNCTIONS: [&str; 14] = [
    "contains",
    "size",
    "max",
    "min",
    "startsWith",
    "endsWith",
    "string",
    "double",
    "int",
    "uint",
    "matches",
    "has",
    "all",
    "exists",
];

/// A compiled definition.
#[derive(Debug)]
pub(crate) struct Compiled {
    pub(crate) name: String,
    pub(crate) version: i64,
    /// The program, or why the stored expression no longer compiles.
    pub(crate) program: Result<Program, String>,
}

/// Why an expression was refused at define time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpressionError {
    /// The interpreter's message (for a syntax error: `ERROR: <input>:line:col: …` and the
    /// offending line with a caret under the position).
    pub message: String,
}

/// Compiles `source`, refusing syntax errors (the parser's message and position) and names
/// outside [`VARIABLES`] and the interpreter's functions.
pub(crate) fn compile(source: &str) -> Result<Program, ExpressionError> {
    let program = Program::compile(source).map_err(|e| ExpressionError {
        message: e.to_string(),
    })?;
    let refs = program.references();
    for v in refs.variables() {
        if !VARIABLES.contains(&v) {
            return Err(ExpressionError {
                message: format!(
                    "unknown variable `{v}`: an expression reads `record` (the record's fields, \
                     e.g. `record.amount`), `key` and `revision`"
                ),
            });
        }
    }
    for f in refs.functions() {
        let operator = f.starts_with('_') || f.starts_with('@') || f.starts_with('!');
        if !operator && !FUNCTIONS.contains(&f) {
            return Err(ExpressionError {
                message: format!("unknown function `{f}`"),
            });
        }
    }
    Ok(program)
}

/// JSON as CEL: integers are `int` (`uint` only beyond `i64`), so `record.amount * 2` works
/// on the numbers records carry.
pub(crate) fn to_cel(v: &Value) -> Cel {
    match v {
        Value::Null => Cel::Null,
        Value::Bool(b) => Cel::Bool(*b),
        Value::Number(n) => {
            if let Some(i) = n.as_i64() {
                Cel::Int(i)
            } else if let Some(u) = n.as_u64() {
                Cel::UInt(u)
            } else {
                Cel::Float(n.as_f64().unwrap_or(f64::NAN))
            }
        }
        Value::String(s) => Cel::String(Arc::new(s.clone())),
        Value::Array(a) => Cel::List(Arc::new(a.iter().map(to_cel).collect())),
        Value::Object(o) => {
            let m: HashMap<String, Cel> = o.iter().map(|(k, v)| (k.clone(), to_cel(v))).collect();
            Cel::Map(m.into())
        }
    }
}

/// One evaluation's stored outcome: a JSON value, or the error the record produced.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Outcome {
    Value(Value),
    Error(String),
}

/// Evaluates `program` on one record. A runtime error (division by zero, a missing field, a
/// wrong type) is that record's error value, never a panic and never a silent `null`.
pub(crate) fn evaluate(program: &Program, key: &str, revision: i64, data: &Value) -> Outcome {
    let mut ctx = Context::default();
    ctx.add_variable_from_value("record", to_cel(data));
    ctx.add_variable_from_value("key", Cel::String(Arc::new(key.to_owned())));
    ctx.add_variable_from_value("revision", Cel::Int(revision));
    // The interpreter is third-party code on user input: a panic in it is this record's error.
    let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| program.execute(&ctx)));
    match run {
        Ok(Ok(v)) => match v.json() {
            Ok(Value::Number(n)) if n.as_f64().is_some_and(|f| !f.is_finite()) => {
                Outcome::Error("the result is not a finite number".into())
            }
            Ok(j) => Outcome::Value(j),
            Err(e) => Outcome::Error(format!("the result has no JSON form: {e}")),
        },
        Ok(Err(e)) => Outcome::Error(describe(&e)),
        Err(_) => Outcome::Error("the expression interpreter failed on this record".into()),
    }
}

fn describe(e: &ExecutionError) -> String {
    match e {
        ExecutionError::NoSuchKey(k) => format!("missing field `{k}`"),
        other => other.to_string(),
    }
}

/// The roll-up: a record with a string `account`, an integer `amount` and a `stage` that does
/// not start with `closed` is an open opportunity; it adds its amount to its account.
pub(crate) fn contribution(data: &Value) -> Option<(String, i64)> {
    let account = data.get("account")?.as_str().filter(|a| !a.is_empty())?;
    let amount = data.get("amount")?.as_i64()?;
    let open = data
        .get("stage")
        .and_then(Value::as_str)
        .is_none_or(|s| !s.starts_with("closed"));
    open.then(|| (account.to_owned(), amount))
}

/// A view row's digest: what it says and what it was derived from. A row edited by hand (its
/// value, error, revision or version changed without this) no longer matches.
pub(crate) fn digest(
    key: &str,
    formula: &str,
    value: Option<&str>,
    error: Option<&str>,
    source_revision: i64,
    version: i64,
) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    for part in [
        key,
        formula,
        value.unwrap_or("\u{0}none"),
        error.unwrap_or("\u{0}none"),
    ] {
        h.update(part.len().to_le_bytes());
        h.update(part.as_bytes());
    }
    h.update(source_revision.to_le_bytes());
    h.update(version.to_le_bytes());
    h.finalize()[..16]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn eval(src: &str, data: Value) -> Outcome {
        evaluate(&compile(src).unwrap(), "k1", 3, &data)
    }

    #[test]
    fn arithmetic_on_record_integers() {
        let r = json!({"amount": 1000, "probability": 40});
        assert_eq!(
            eval("record.amount * record.probability / 100", r),
            Outcome::Value(json!(400))
        );
    }

    #[test]
    fn conditionals_strings_key_and_revision() {
        let r = json!({"stage": "won", "amount": 7, "name": "Acme"});
        assert_eq!(
            eval("record.stage == 'won' ? record.amount : 0", r.clone()),
            Outcome::Value(json!(7))
        );
        assert_eq!(
            eval("record.name + ' (' + key + ')'", r.clone()),
            Outcome::Value(json!("Acme (k1)"))
        );
        assert_eq!(eval("revision + 1", r), Outcome::Value(json!(4)));
    }

    #[test]
    fn runtime_errors_are_values() {
        let r = json!({"amount": 10, "zero": 0, "name": "x"});
        let Outcome::Error(e) = eval("record.amount / record.zero", r.clone()) else {
            panic!("division by zero must be an error")
        };
        assert!(e.to_lowercase().contains("zero"), "{e}");
        assert_eq!(
            eval("record.missing + 1", r.clone()),
            Outcome::Error("missing field `missing`".into())
        );
        assert!(matches!(
            eval("record.amount + record.name", r),
            Outcome::Error(_)
        ));
    }

    #[test]
    fn syntax_errors_carry_the_position() {
        let e = compile("record.amount +").unwrap_err();
        assert!(e.message.contains("1:16"), "{}", e.message);
        let e = compile("amount * 2").unwrap_err();
        assert!(
            e.message.contains("unknown variable `amount`"),
            "{}",
            e.message
        );
        let e = compile("launch(record)").unwrap_err();
        assert!(
            e.message.contains("unknown function `launch`"),
            "{}",
            e.message
        );
        assert!(compile("has(record.x) ? size(record.name) : 0").is_ok());
    }

    #[test]
    fn contribution_counts_open_opportunities() {
        assert_eq!(
            contribution(&json!({"account": "a", "amount": 5, "stage": "open"})),
            Some(("a".into(), 5))
        );
        assert_eq!(
            contribution(&json!({"account": "a", "amount": 5})),
            Some(("a".into(), 5))
        );
        assert_eq!(
            contribution(&json!({"account": "a", "amount": 5, "stage": "closed_won"})),
            None
        );
        assert_eq!(contribution(&json!({"account": "a", "amount": 5.5})), None);
        assert_eq!(contribution(&json!({"amount": 5})), None);
    }

    #[test]
    fn digest_changes_with_every_part() {
        let d = digest("k", "f", Some("1"), None, 2, 3);
        assert_eq!(d.len(), 32);
        assert_ne!(d, digest("k", "f", Some("2"), None, 2, 3));
        assert_ne!(d, digest("k", "f", None, Some("1"), 2, 3));
        assert_ne!(d, digest("k", "f", Some("1"), None, 1, 3));
        assert_ne!(d, digest("k", "f", Some("1"), None, 2, 4));
        assert_ne!(d, digest("k", "g", Some("1"), None, 2, 3));
    }
}

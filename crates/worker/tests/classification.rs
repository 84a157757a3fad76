//! Classification: the coherence table, round-trips, and total parsing.

use nexuscrm_worker::{Classification, Declaration, Durability, Effect};
use proptest::prelude::*;

/// The contract's coherence table, written out independently of `Durability::accepts`.
fn coherent(d: Durability, e: Effect) -> bool {
    use Durability::*;
    use Effect::*;
    match d {
        DurableCritical => [Transactional, IdempotentOrObservable, OutcomeUncertain].contains(&e),
        DerivedReconcilable => e == Convergent,
        BestEffort => e == LossTolerant,
    }
}

fn durability() -> impl Strategy<Value = Durability> {
    prop::sample::select(Durability::ALL.to_vec())
}

fn effect() -> impl Strategy<Value = Effect> {
    prop::sample::select(Effect::ALL.to_vec())
}

fn family() -> impl Strategy<Value = String> {
    "[a-z0-9._-]{1,64}"
}

/// Cases per arbitrary-input property: `NEXUSCRM_PROPTEST_CASES` (the documented full run uses
/// 100,000), 2,000 by default.
fn arbitrary_cases() -> ProptestConfig {
    let cases = std::env::var("NEXUSCRM_PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2_000);
    ProptestConfig::with_cases(cases)
}

proptest! {
    #![proptest_config(arbitrary_cases())]

    #[test]
    fn every_pair_is_accepted_or_rejected_exactly_as_the_table_says(
        d in durability(), e in effect(), f in family()
    ) {
        let decl = Declaration::new(f.clone(), d, e);
        prop_assert_eq!(decl.is_ok(), coherent(d, e));
        let text = format!("{d}/{e}");
        prop_assert_eq!(text.parse::<Classification>().is_ok(), coherent(d, e));
        match decl {
            Ok(decl) => {
                let shown = decl.to_string();
                prop_assert_eq!(&shown, &format!("{f}={d}/{e}"));
                let back: Declaration = shown.parse().unwrap();
                prop_assert_eq!(back, decl);
                let class: Classification = text.parse().unwrap();
                prop_assert_eq!(class.to_string(), text);
            }
            Err(err) => {
                prop_assert!(err.is_incoherent());
                prop_assert_eq!(err.family(), Some(f.as_str()));
                let msg = err.to_string();
                prop_assert!(msg.contains(&f), "{}", msg);
                prop_assert!(msg.contains("incoherent"), "{}", msg);
                let parsed = format!("{f}={d}/{e}").parse::<Declaration>().unwrap_err();
                prop_assert_eq!(parsed.family(), Some(f.as_str()));
            }
        }
    }

    #[test]
    fn parsing_any_text_never_panics(s in any::<String>()) {
        let _ = s.parse::<Declaration>();
        let _ = s.parse::<Classification>();
        let _ = s.parse::<Durability>();
        let _ = s.parse::<Effect>();
    }

    #[test]
    fn parsing_near_miss_text_never_panics(s in "[a-z=/ -]{0,80}") {
        if let Ok(d) = s.parse::<Declaration>() {
            prop_assert_eq!(d.to_string(), s);
        }
    }
}

#[test]
fn unknown_words_and_bad_names_are_explained() {
    let e = "bulk=durable/transactional"
        .parse::<Declaration>()
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("unknown durability class \"durable\""),
        "{e}"
    );
    let e = "bulk=best-effort/lossy".parse::<Declaration>().unwrap_err();
    assert!(
        e.to_string().contains("unknown effect semantic \"lossy\""),
        "{e}"
    );
    let e = "Bulk Jobs=best-effort/loss-tolerant"
        .parse::<Declaration>()
        .unwrap_err();
    assert!(e.to_string().contains("invalid work family name"), "{e}");
    let e = "best-effort".parse::<Classification>().unwrap_err();
    assert!(e.to_string().contains("expected"), "{e}");
    let e = Declaration::new("audit", Durability::BestEffort, Effect::Transactional).unwrap_err();
    assert_eq!(
        e.to_string(),
        "work family `audit`: best-effort/transactional is incoherent: best-effort work may be \
         lost by contract, so its effect must be loss-tolerant"
    );
}

#[test]
fn const_declarations_work_in_const_context() {
    const BULK: Declaration =
        Declaration::new_const("bulk", Durability::DurableCritical, Effect::Transactional);
    assert_eq!(BULK.family(), "bulk");
    assert_eq!(BULK.effect(), Effect::Transactional);
}

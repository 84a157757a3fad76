//! Reliability classification: what a producer acknowledgement promises.
//!
//! Every work family declares one [`Durability`] and one [`Effect`]. Only coherent pairs can be
//! constructed:
//!
//! | durability             | accepted effects                                                    |
//! |------------------------|---------------------------------------------------------------------|
//! | `durable-critical`     | `transactional`, `idempotent-or-observable`, `outcome-uncertain`    |
//! | `derived-reconcilable` | `convergent`                                                        |
//! | `best-effort`          | `loss-tolerant`                                                     |
//!
//! The declaration is a claim, not a proof: real producer/store/worker tests provide the proof.

use std::borrow::Cow;
use std::error::Error;
use std::fmt;
use std::str::FromStr;

/// What an acknowledgement promises about survival of accepted work.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Durability {
    /// Accepted work survives a process crash and reaches a durable terminal, poison, or
    /// uncertain state.
    DurableCritical,
    /// Canonical source state stays authoritative; a fresh process converges the derived effect
    /// without replaying every event.
    DerivedReconcilable,
    /// Loss is an explicit product contract; the path must not claim completeness.
    BestEffort,
}

/// How the effect of an attempt relates to its disposition.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Effect {
    /// Effect and disposition commit in one domain transaction.
    Transactional,
    /// A stable key or queryable outcome makes replay safe.
    IdempotentOrObservable,
    /// Ambiguous external results are quarantined, never blindly replayed.
    OutcomeUncertain,
    /// Repeated derivation converges to canonical source state.
    Convergent,
    /// Loss is allowed by the best-effort contract.
    LossTolerant,
}

impl Durability {
    /// Every durability class, in declaration order.
    pub const ALL: [Durability; 3] = [
        Durability::DurableCritical,
        Durability::DerivedReconcilable,
        Durability::BestEffort,
    ];

    /// The contract's kebab-case word for this class.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            Durability::DurableCritical => "durable-critical",
            Durability::DerivedReconcilable => "derived-reconcilable",
            Durability::BestEffort => "best-effort",
        }
    }

    /// Whether `effect` is a coherent effect semantic for this durability class.
    #[must_use]
    pub const fn accepts(self, effect: Effect) -> bool {
        matches!(
            (self, effect),
            (
                Durability::DurableCritical,
                Effect::Transactional | Effect::IdempotentOrObservable | Effect::OutcomeUncertain
            ) | (Durability::DerivedReconcilable, Effect::Convergent)
                | (Durability::BestEffort, Effect::LossTolerant)
        )
    }

    const fn requirement(self) -> &'static str {
        match self {
            Durability::DurableCritical => {
                "durable-critical work must reach a durable outcome, so its effect must be \
                 transactional, idempotent-or-observable or outcome-uncertain"
            }
            Durability::DerivedReconcilable => {
                "derived-reconcilable work is re-derived from canonical state, so its effect must \
                 be convergent"
            }
            Durability::BestEffort => {
                "best-effort work may be lost by contract, so its effect must be loss-tolerant"
            }
        }
    }
}

impl Effect {
    /// Every effect semantic, in declaration order.
    pub const ALL: [Effect; 5] = [
        Effect::Transactional,
        Effect::IdempotentOrObservable,
        Effect::OutcomeUncertain,
        Effect::Convergent,
        Effect::LossTolerant,
    ];

    /// The contract's kebab-case word for this effect.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            Effect::Transactional => "transactional",
            Effect::IdempotentOrObservable => "idempotent-or-observable",
            Effect::OutcomeUncertain => "outcome-uncertain",
            Effect::Convergent => "convergent",
            Effect::LossTolerant => "loss-tolerant",
        }
    }
}

impl fmt::Display for Durability {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl fmt::Display for Effect {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Durability {
    type Err = DeclarationError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Durability::ALL
            .into_iter()
            .find(|d| d.as_str() == s)
            .ok_or_else(|| DeclarationError::new(None, ErrorKind::UnknownDurability(s.into())))
    }
}

impl FromStr for Effect {
    type Err = DeclarationError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Effect::ALL
            .into_iter()
            .find(|e| e.as_str() == s)
            .ok_or_else(|| DeclarationError::new(None, ErrorKind::UnknownEffect(s.into())))
    }
}

/// A coherent durability/effect pair, written `durable-critical/transactional`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Classification {
    durability: Durability,
    effect: Effect,
}

impl Classification {
    /// Builds a pair, or says why it is incoherent.
    pub fn new(durability: Durability, effect: Effect) -> Result<Self, DeclarationError> {
        if durability.accepts(effect) {
            Ok(Classification { durability, effect })
        } else {
            Err(DeclarationError::new(
                None,
                ErrorKind::Incoherent { durability, effect },
            ))
        }
    }

    /// Builds a pair in a `const` context; an incoherent pair fails compilation there (and
    /// panics if evaluated at run time).
    ///
    /// ```compile_fail
    /// use nexuscrm_worker::{Classification, Durability, Effect};
    /// const BAD: Classification = Classification::new_const(Durability::BestEffort, Effect::Transactional);
    /// ```
    #[must_use]
    pub const fn new_const(durability: Durability, effect: Effect) -> Self {
        assert!(
            durability.accepts(effect),
            "incoherent durability/effect pair"
        );
        Classification { durability, effect }
    }

    /// The durability class.
    #[must_use]
    pub const fn durability(self) -> Durability {
        self.durability
    }

    /// The effect semantic.
    #[must_use]
    pub const fn effect(self) -> Effect {
        self.effect
    }
}

impl fmt::Display for Classification {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.durability, self.effect)
    }
}

impl FromStr for Classification {
    type Err = DeclarationError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (d, e) = s
            .split_once('/')
            .ok_or_else(|| DeclarationError::new(None, ErrorKind::Syntax(s.into())))?;
        Classification::new(d.parse()?, e.parse()?)
    }
}

/// A work family's reliability declaration: its name and a coherent [`Classification`].
///
/// Written `bulk=durable-critical/transactional`; parsing and display round-trip.
///
/// ```
/// use nexuscrm_worker::{Declaration, Durability, Effect};
/// const BULK: Declaration =
///     Declaration::new_const("bulk", Durability::DurableCritical, Effect::Transactional);
/// assert_eq!(BULK.to_string(), "bulk=durable-critical/transactional");
/// let err = Declaration::new("audit", Durability::BestEffort, Effect::Transactional).unwrap_err();
/// assert!(err.to_string().contains("audit"));
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Declaration {
    family: Cow<'static, str>,
    class: Classification,
}

impl Declaration {
    /// Declares `family`, or says (naming the family) why the pair or the name is rejected.
    ///
    /// A family name is 1 to 64 characters of ASCII lower-case letters, digits, `-`, `_` or `.`.
    pub fn new(
        family: impl Into<String>,
        durability: Durability,
        effect: Effect,
    ) -> Result<Self, DeclarationError> {
        let family = family.into();
        if !valid_family(&family) {
            return Err(DeclarationError::new(
                None,
                ErrorKind::BadFamily(family.clone()),
            ));
        }
        let class = Classification::new(durability, effect).map_err(|e| e.for_family(&family))?;
        Ok(Declaration {
            family: Cow::Owned(family),
            class,
        })
    }

    /// Declares `family` in a `const` context; an incoherent pair or bad name fails compilation.
    ///
    /// ```compile_fail
    /// use nexuscrm_worker::{Declaration, Durability, Effect};
    /// const BAD: Declaration =
    ///     Declaration::new_const("flow", Durability::DerivedReconcilable, Effect::LossTolerant);
    /// ```
    #[must_use]
    pub const fn new_const(family: &'static str, durability: Durability, effect: Effect) -> Self {
        assert!(valid_family_const(family.as_bytes()), "invalid family name");
        Declaration {
            family: Cow::Borrowed(family),
            class: Classification::new_const(durability, effect),
        }
    }

    /// The family name.
    #[must_use]
    pub fn family(&self) -> &str {
        &self.family
    }

    /// The coherent durability/effect pair.
    #[must_use]
    pub const fn classification(&self) -> Classification {
        self.class
    }

    /// The durability class.
    #[must_use]
    pub const fn durability(&self) -> Durability {
        self.class.durability
    }

    /// The effect semantic.
    #[must_use]
    pub const fn effect(&self) -> Effect {
        self.class.effect
    }
}

fn valid_family(s: &str) -> bool {
    valid_family_const(s.as_bytes())
}

const fn valid_family_const(b: &[u8]) -> bool {
    if b.is_empty() || b.len() > 64 {
        return false;
    }
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'-' || c == b'_' || c == b'.') {
            return false;
        }
        i += 1;
    }
    true
}

impl fmt::Display for Declaration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}={}", self.family, self.class)
    }
}

impl FromStr for Declaration {
    type Err = DeclarationError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (family, pair) = s
            .split_once('=')
            .ok_or_else(|| DeclarationError::new(None, ErrorKind::Syntax(s.into())))?;
        let class: Classification = pair.parse().map_err(|e: DeclarationError| {
            if valid_family(family) {
                e.for_family(family)
            } else {
                e
            }
        })?;
        Declaration::new(family, class.durability, class.effect)
    }
}

/// Why a declaration, classification or class word was rejected.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeclarationError {
    family: Option<String>,
    kind: ErrorKind,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum ErrorKind {
    UnknownDurability(String),
    UnknownEffect(String),
    Syntax(String),
    BadFamily(String),
    Incoherent {
        durability: Durability,
        effect: Effect,
    },
}

impl DeclarationError {
    fn new(family: Option<String>, kind: ErrorKind) -> Self {
        DeclarationError { family, kind }
    }

    fn for_family(mut self, family: &str) -> Self {
        self.family = Some(family.to_owned());
        self
    }

    /// Whether the words were valid but the pair is incoherent.
    #[must_use]
    pub fn is_incoherent(&self) -> bool {
        matches!(self.kind, ErrorKind::Incoherent { .. })
    }

    /// The family the error is about, when known.
    #[must_use]
    pub fn family(&self) -> Option<&str> {
        self.family.as_deref()
    }
}

impl fmt::Display for DeclarationError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(family) = &self.family {
            write!(f, "work family `{family}`: ")?;
        }
        match &self.kind {
            ErrorKind::UnknownDurability(s) => write!(
                f,
                "unknown durability class {s:?} (expected durable-critical, \
                 derived-reconcilable or best-effort)"
            ),
            ErrorKind::UnknownEffect(s) => write!(
                f,
                "unknown effect semantic {s:?} (expected transactional, \
                 idempotent-or-observable, outcome-uncertain, convergent or loss-tolerant)"
            ),
            ErrorKind::Syntax(s) => write!(
                f,
                "cannot parse {s:?}: expected `family=durability/effect` or `durability/effect`"
            ),
            ErrorKind::BadFamily(s) => write!(
                f,
                "invalid work family name {s:?}: use 1 to 64 of a-z, 0-9, `-`, `_`, `.`"
            ),
            ErrorKind::Incoherent { durability, effect } => write!(
                f,
                "{durability}/{effect} is incoherent: {}",
                durability.requirement()
            ),
        }
    }
}

impl Error for DeclarationError {}

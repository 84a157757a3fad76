//! Schedule specs (cron with seconds in an IANA zone, or a fixed interval), misfire policies, and
//! the occurrence arithmetic the reservation uses.
//!
//! Cron parsing and evaluation, including daylight-saving gaps and repeats, are the
//! [`croner`] crate's, following its documented rules (OCPS / Vixie cron):
//!
//! - **Gap (spring forward)**: a fixed-time job (`0 30 2 * * *`) whose wall time does not exist
//!   runs at the first valid time after the gap, the same day (03:00); an interval or wildcard
//!   job (`0 */15 * * * *`) skips the occurrences inside the gap.
//! - **Repeat (fall back)**: a fixed-time job runs once, at the first of the two instants; an
//!   interval or wildcard job runs at each instant of both passes.
//!
//! Times here are epoch milliseconds (the store's unit); cron occurrences fall on whole seconds.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use chrono::{DateTime, Utc};
use chrono_tz::Tz;
use croner::Cron;
use croner::parser::{CronParser, Seconds};

/// The shortest accepted interval.
pub const MIN_INTERVAL: Duration = Duration::from_secs(1);
/// The longest accepted interval.
pub const MAX_INTERVAL: Duration = Duration::from_secs(366 * 24 * 3600);
/// The largest accepted catch-up bound.
pub const MAX_CATCH_UP: u32 = 10_000;
/// Forward steps the reservation takes through a cron gap before it searches backward instead.
const FORWARD_STEP_LIMIT: usize = 100_000;

/// When a schedule fires.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Spec {
    /// A cron expression in an IANA time zone. Six fields (`sec min hour dom month dow`) give
    /// second granularity; five fields (`min hour dom month dow`) fire at second 0.
    Cron {
        /// The expression, e.g. `0 30 9 * * MON-FRI`.
        expr: String,
        /// The IANA zone the expression's wall times are in, e.g. `America/New_York`.
        zone: String,
    },
    /// Every `every`, aligned to the schedule's anchor (its start time, or the Unix epoch when
    /// it has none): `every 30s` fires at :00 and :30 of each minute.
    Every(Duration),
}

impl Spec {
    /// A cron spec.
    #[must_use]
    pub fn cron(expr: impl Into<String>, zone: impl Into<String>) -> Spec {
        Spec::Cron {
            expr: expr.into(),
            zone: zone.into(),
        }
    }

    /// The stored kind: `cron` or `interval`.
    #[must_use]
    pub fn kind(&self) -> &'static str {
        match self {
            Spec::Cron { .. } => "cron",
            Spec::Every(_) => "interval",
        }
    }
}

impl fmt::Display for Spec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Spec::Cron { expr, zone } => write!(f, "cron '{expr}' in {zone}"),
            Spec::Every(d) => write!(f, "every {}", format_duration(*d)),
        }
    }
}

/// What a reservation does with occurrences that passed while no worker ran.
///
/// With a cursor at `c` and the worker reserving at `now`, the *due* occurrences are those in
/// `[c, now]`. Under normal operation there is exactly one, and every policy runs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MisfirePolicy {
    /// One run for the whole gap, at its latest due occurrence; the rest are coalesced into it.
    FireOnce,
    /// No run for missed occurrences: the latest due occurrence runs only if it is within the
    /// misfire grace of `now` (see [`FlowConfig::misfire_grace`](crate::FlowConfig)); the
    /// cursor resumes from now either way.
    Skip,
    /// A run for every due occurrence, at most `max` of them (the most recent `max`; older
    /// ones are dropped).
    CatchUp {
        /// The bound, 1 to [`MAX_CATCH_UP`].
        max: u32,
    },
}

impl MisfirePolicy {
    /// The stored name: `fire-once`, `skip` or `catch-up`.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            MisfirePolicy::FireOnce => "fire-once",
            MisfirePolicy::Skip => "skip",
            MisfirePolicy::CatchUp { .. } => "catch-up",
        }
    }

    /// Parses a stored or typed policy name; `catch_up_max` bounds `catch-up`.
    ///
    /// # Errors
    ///
    /// An unknown name, or a bound outside 1 to [`MAX_CATCH_UP`].
    pub fn parse(name: &str, catch_up_max: u32) -> Result<MisfirePolicy, String> {
        match name {
            "fire-once" => Ok(MisfirePolicy::FireOnce),
            "skip" => Ok(MisfirePolicy::Skip),
            "catch-up" if (1..=MAX_CATCH_UP).contains(&catch_up_max) => {
                Ok(MisfirePolicy::CatchUp { max: catch_up_max })
            }
            "catch-up" => Err(format!(
                "catch-up maximum {catch_up_max} is outside 1..={MAX_CATCH_UP}"
            )),
            other => Err(format!(
                "unknown misfire policy {other:?}: expected fire-once, skip or catch-up"
            )),
        }
    }

    pub(crate) fn catch_up_max(self) -> u32 {
        match self {
            MisfirePolicy::CatchUp { max } => max,
            _ => 1,
        }
    }
}

impl fmt::Display for MisfirePolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MisfirePolicy::CatchUp { max } => write!(f, "catch-up (max {max})"),
            other => f.write_str(other.name()),
        }
    }
}

/// A validated, evaluable spec.
#[derive(Debug, Clone)]
pub(crate) enum Timing {
    Cron(Box<Cron>, Tz),
    Every { every_ms: i64, anchor_ms: i64 },
}

fn parser() -> CronParser {
    CronParser::builder().seconds(Seconds::Optional).build()
}

/// Parses and checks `spec`, anchoring an interval at `anchor_ms`.
pub(crate) fn timing(spec: &Spec, anchor_ms: i64) -> Result<Timing, String> {
    match spec {
        Spec::Cron { expr, zone } => {
            let tz = Tz::from_str(zone).map_err(|_| {
                format!("unknown time zone {zone:?}: use an IANA name such as Europe/Berlin")
            })?;
            if expr.len() > 255 {
                return Err("cron expression is longer than 255 characters".into());
            }
            let cron = parser()
                .parse(expr)
                .map_err(|e| format!("invalid cron expression {expr:?}: {e}"))?;
            Ok(Timing::Cron(Box::new(cron), tz))
        }
        Spec::Every(d) => {
            if *d < MIN_INTERVAL || *d > MAX_INTERVAL {
                return Err(format!(
                    "interval {} is outside 1s..=366d",
                    format_duration(*d)
                ));
            }
            if d.subsec_nanos() % 1_000_000 != 0 {
                return Err("interval must be a whole number of milliseconds".into());
            }
            Ok(Timing::Every {
                every_ms: d.as_millis() as i64,
                anchor_ms,
            })
        }
    }
}

fn at(tz: &Tz, second: i64) -> Option<DateTime<Tz>> {
    DateTime::<Utc>::from_timestamp(second, 0).map(|t| t.with_timezone(tz))
}

impl Timing {
    /// The first occurrence strictly after `t`.
    pub(crate) fn next_after(&self, t: i64) -> Option<i64> {
        match self {
            Timing::Every {
                every_ms,
                anchor_ms,
            } => {
                if t < *anchor_ms {
                    return Some(*anchor_ms);
                }
                let k = (t - anchor_ms).div_euclid(*every_ms) + 1;
                anchor_ms.checked_add(k.checked_mul(*every_ms)?)
            }
            Timing::Cron(cron, tz) => {
                let start = at(tz, t.div_euclid(1000))?;
                let next = cron.find_next_occurrence(&start, false).ok()?;
                Some(next.timestamp() * 1000)
            }
        }
    }

    /// The first occurrence at or after `t`.
    pub(crate) fn at_or_after(&self, t: i64) -> Option<i64> {
        self.next_after(t - 1)
    }

    fn previous_at_or_before(&self, t: i64) -> Option<i64> {
        match self {
            Timing::Every {
                every_ms,
                anchor_ms,
            } => {
                if t < *anchor_ms {
                    return None;
                }
                Some(anchor_ms + (t - anchor_ms).div_euclid(*every_ms) * every_ms)
            }
            Timing::Cron(cron, tz) => {
                let start = at(tz, t.div_euclid(1000))?;
                let prev = cron.find_previous_occurrence(&start, true).ok()?;
                Some(prev.timestamp() * 1000)
            }
        }
    }

    /// The most recent `keep` occurrences in `[from, to]`, ascending, and whether older due
    /// occurrences were left out.
    pub(crate) fn due(&self, from: i64, to: i64, keep: usize) -> (Vec<i64>, bool) {
        if from > to || keep == 0 {
            return (Vec::new(), false);
        }
        match self {
            Timing::Every {
                every_ms,
                anchor_ms,
            } => {
                let Some(first) = self.at_or_after(from) else {
                    return (Vec::new(), false);
                };
                if first > to {
                    return (Vec::new(), false);
                }
                let last = anchor_ms + (to - anchor_ms).div_euclid(*every_ms) * every_ms;
                let count = (last - first) / every_ms + 1;
                let kept = count.min(keep as i64);
                let start = last - (kept - 1) * every_ms;
                (
                    (0..kept).map(|i| start + i * every_ms).collect(),
                    count > kept,
                )
            }
            Timing::Cron(..) => {
                // Forward from the cursor (the direction croner's gap rules are written for),
                // keeping the newest `keep`.
                let mut ring = std::collections::VecDeque::with_capacity(keep.min(1024));
                let mut dropped = false;
                let mut next = self.at_or_after(from);
                let mut steps = 0;
                while let Some(t) = next {
                    if t > to {
                        return (ring.into(), dropped);
                    }
                    if ring.len() == keep {
                        ring.pop_front();
                        dropped = true;
                    }
                    ring.push_back(t);
                    steps += 1;
                    if steps >= FORWARD_STEP_LIMIT {
                        break;
                    }
                    next = self.next_after(t);
                }
                if next.is_none() {
                    return (ring.into(), dropped);
                }
                // A very long gap: collect the newest `keep` backward from `to` instead.
                let mut back = Vec::with_capacity(keep.min(1024));
                let mut cursor = self.previous_at_or_before(to);
                while let Some(t) = cursor {
                    if t < from || back.len() == keep {
                        break;
                    }
                    back.push(t);
                    cursor = self.previous_at_or_before(t - 1000);
                }
                back.reverse();
                (back, true)
            }
        }
    }
}

/// What one reservation does: the occurrences to run and where the cursor goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Plan {
    /// Occurrences to insert runs for, ascending.
    pub(crate) runs: Vec<i64>,
    /// The cursor after this reservation: `None` when the spec never fires again.
    pub(crate) cursor: Option<i64>,
    /// Whether the due occurrences are all handled (otherwise another chunk follows).
    pub(crate) complete: bool,
}

/// The reservation plan for a schedule whose cursor is `cursor`, at `now`, inserting at most
/// `chunk` runs in this transaction.
pub(crate) fn plan(
    timing: &Timing,
    policy: MisfirePolicy,
    cursor: i64,
    now: i64,
    grace_ms: i64,
    chunk: usize,
) -> Plan {
    if cursor > now {
        return Plan {
            runs: Vec::new(),
            cursor: Some(cursor),
            complete: true,
        };
    }
    let after_now = timing.next_after(now);
    match policy {
        MisfirePolicy::FireOnce | MisfirePolicy::Skip => {
            let (latest, _) = timing.due(cursor, now, 1);
            let runs = match (policy, latest.first()) {
                (MisfirePolicy::Skip, Some(&t)) if now - t > grace_ms => Vec::new(),
                _ => latest,
            };
            Plan {
                runs,
                cursor: after_now,
                complete: true,
            }
        }
        MisfirePolicy::CatchUp { max } => {
            let (window, _) = timing.due(cursor, now, max as usize);
            if window.len() <= chunk {
                return Plan {
                    runs: window,
                    cursor: after_now,
                    complete: true,
                };
            }
            let runs: Vec<i64> = window[..chunk].to_vec();
            Plan {
                cursor: Some(window[chunk]),
                runs,
                complete: false,
            }
        }
    }
}

/// Formats a time as RFC 3339 in UTC with milliseconds, e.g. `2026-12-02T14:00:00.000Z`.
#[must_use]
pub fn format_time(t: std::time::SystemTime) -> String {
    DateTime::<Utc>::from(t)
        .format("%Y-%m-%dT%H:%M:%S%.3fZ")
        .to_string()
}

/// Formats a duration the way [`parse_duration`] reads it.
#[must_use]
pub fn format_duration(d: Duration) -> String {
    let ms = d.as_millis();
    for (unit, size) in [
        ("d", 86_400_000),
        ("h", 3_600_000),
        ("m", 60_000),
        ("s", 1000),
    ] {
        if ms >= size && ms.is_multiple_of(size) {
            return format!("{}{unit}", ms / size);
        }
    }
    format!("{ms}ms")
}

/// The longest duration [`parse_duration`] accepts: 366 days (an interval or a start offset
/// beyond a year is a typo, not a schedule).
pub const MAX_DURATION: Duration = Duration::from_secs(366 * 86_400);

/// Parses `500ms`, `30s`, `5m`, `2h` or `1d`, at most [`MAX_DURATION`].
///
/// # Errors
///
/// Anything else, with the input (shortened when long) in the message.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    if s.len() > 32 {
        let mut end = 32;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        return Err(format!(
            "invalid duration {:?}… ({} bytes): expected e.g. 30s, 5m, 2h",
            &s[..end],
            s.len()
        ));
    }
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (n, unit) = s.split_at(split);
    let n: u64 = n
        .parse()
        .map_err(|_| format!("invalid duration {s:?}: expected e.g. 30s, 5m, 2h"))?;
    let ms = match unit {
        "ms" => 1,
        "s" => 1000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => {
            return Err(format!(
                "invalid duration {s:?}: the unit must be ms, s, m, h or d"
            ));
        }
    };
    n.checked_mul(ms)
        .map(Duration::from_millis)
        .filter(|d| *d <= MAX_DURATION)
        .ok_or_else(|| format!("duration {s:?} is too large: at most 366d"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    fn ms(tz: Tz, y: i32, mo: u32, d: u32, h: u32, mi: u32, s: u32) -> i64 {
        tz.with_ymd_and_hms(y, mo, d, h, mi, s)
            .earliest()
            .unwrap()
            .timestamp_millis()
    }

    fn ny() -> Tz {
        "America/New_York".parse().unwrap()
    }

    fn cron(expr: &str) -> Timing {
        timing(&Spec::cron(expr, "America/New_York"), 0).unwrap()
    }

    #[test]
    fn a_fixed_time_in_the_spring_gap_runs_right_after_the_gap() {
        // 2026-03-08 02:00 EST jumps to 03:00 EDT in New York: 02:30 does not exist.
        let t = cron("0 30 2 * * *");
        let before = ms(ny(), 2026, 3, 8, 1, 0, 0);
        assert_eq!(t.next_after(before), Some(ms(ny(), 2026, 3, 8, 3, 0, 0)));
        // And on the next day at 02:30 again.
        assert_eq!(
            t.next_after(ms(ny(), 2026, 3, 8, 3, 0, 0)),
            Some(ms(ny(), 2026, 3, 9, 2, 30, 0))
        );
    }

    #[test]
    fn an_interval_job_skips_the_occurrences_inside_the_spring_gap() {
        let t = cron("0 */30 * * * *");
        let from = ms(ny(), 2026, 3, 8, 1, 30, 0);
        let (due, dropped) = t.due(from, from + 3_600_000 - 1, 10);
        // 01:30 EST, then 03:00 EDT (half a real hour later: 02:00 and 02:30 do not exist);
        // 03:30 EDT is one real hour after 01:30, outside the window.
        assert_eq!(due, vec![from, ms(ny(), 2026, 3, 8, 3, 0, 0)]);
        assert_eq!(due[1] - due[0], 30 * 60_000);
        assert!(!dropped);
    }

    #[test]
    fn a_fixed_time_in_the_fall_repeat_runs_once_and_an_interval_job_runs_in_both_passes() {
        // 2026-11-01 02:00 EDT falls back to 01:00 EST: 01:00-01:59 happens twice.
        let first_0130 = ny()
            .with_ymd_and_hms(2026, 11, 1, 1, 30, 0)
            .earliest()
            .unwrap()
            .timestamp_millis();
        let fixed = cron("0 30 1 * * *");
        let start = ms(ny(), 2026, 11, 1, 0, 0, 0);
        let (due, _) = fixed.due(start, start + 4 * 3_600_000, 10);
        assert_eq!(due, vec![first_0130], "once, at the first 01:30");
        let every = cron("0 30 * * * *");
        let (due, _) = every.due(start, start + 4 * 3_600_000, 10);
        // 00:30 EDT, 01:30 EDT, 01:30 EST, 02:30 EST: four real hours end at 03:00 EST.
        assert_eq!(due.len(), 4, "{due:?}");
        assert_eq!(due[1], first_0130);
        assert_eq!(due[2] - due[1], 3_600_000, "both passes of 01:30");
    }

    #[test]
    fn bad_specs_are_rejected_with_the_reason() {
        let e = timing(&Spec::cron("0 61 * * * *", "UTC"), 0).unwrap_err();
        assert!(e.contains("invalid cron expression"), "{e}");
        let e = timing(&Spec::cron("0 0 * * * *", "Mars/Olympus"), 0).unwrap_err();
        assert!(e.contains("unknown time zone"), "{e}");
        let e = timing(&Spec::Every(Duration::from_millis(10)), 0).unwrap_err();
        assert!(e.contains("outside"), "{e}");
        assert!(MisfirePolicy::parse("sometimes", 1).is_err());
        assert!(MisfirePolicy::parse("catch-up", 0).is_err());
    }

    #[test]
    fn intervals_align_to_the_anchor() {
        let t = timing(&Spec::Every(Duration::from_secs(30)), 1_000).unwrap();
        assert_eq!(t.next_after(0), Some(1_000));
        assert_eq!(t.next_after(1_000), Some(31_000));
        assert_eq!(t.at_or_after(31_000), Some(31_000));
        let (due, dropped) = t.due(1_000, 100_000, 2);
        assert_eq!(due, vec![61_000, 91_000]);
        assert!(dropped);
    }

    #[test]
    fn policies_plan_exactly() {
        let t = timing(&Spec::Every(Duration::from_secs(60)), 0).unwrap();
        // Cursor at 60 s, the worker returns at 10 min 30 s: 10 occurrences are due.
        let (cursor, now) = (60_000, 630_000);
        let once = plan(&t, MisfirePolicy::FireOnce, cursor, now, 10_000, 100);
        assert_eq!(once.runs, vec![600_000]);
        assert_eq!(once.cursor, Some(660_000));
        let skip = plan(&t, MisfirePolicy::Skip, cursor, now, 10_000, 100);
        assert!(skip.runs.is_empty());
        assert_eq!(skip.cursor, Some(660_000));
        // On time (within the grace), skip runs the occurrence.
        let on_time = plan(&t, MisfirePolicy::Skip, 600_000, 605_000, 10_000, 100);
        assert_eq!(on_time.runs, vec![600_000]);
        let all = plan(&t, MisfirePolicy::CatchUp { max: 100 }, cursor, now, 0, 100);
        assert_eq!(all.runs.len(), 10);
        assert_eq!(all.cursor, Some(660_000));
        let bounded = plan(&t, MisfirePolicy::CatchUp { max: 3 }, cursor, now, 0, 100);
        assert_eq!(bounded.runs, vec![480_000, 540_000, 600_000]);
        let chunked = plan(&t, MisfirePolicy::CatchUp { max: 100 }, cursor, now, 0, 4);
        assert_eq!(chunked.runs, vec![60_000, 120_000, 180_000, 240_000]);
        assert_eq!(chunked.cursor, Some(300_000));
        assert!(!chunked.complete);
        // Nothing due: no runs, the cursor stays where it is.
        let early = plan(&t, MisfirePolicy::FireOnce, 660_000, 630_000, 0, 4);
        assert!(early.runs.is_empty());
        assert_eq!(early.cursor, Some(660_000));
    }

    #[test]
    fn durations_round_trip() {
        for s in ["500ms", "30s", "5m", "2h", "1d"] {
            assert_eq!(format_duration(parse_duration(s).unwrap()), s);
        }
        assert!(parse_duration("5 parsecs").is_err());
        assert_eq!(parse_duration("366d").unwrap(), MAX_DURATION);
        for big in ["367d", "999999999999s", "18446744073709551615d"] {
            let e = parse_duration(big).unwrap_err();
            assert!(e.contains("at most 366d"), "{big}: {e}");
        }
        let e = parse_duration(&"9".repeat(1_000_000)).unwrap_err();
        assert!(
            e.len() < 120,
            "a long input is not echoed whole: {}",
            e.len()
        );
        assert!(parse_duration("").is_err());
    }

    proptest::proptest! {
        #[test]
        fn interval_due_windows_are_exact(anchor in 0i64..10_000_000, every in 1_000i64..100_000,
                                          from in 0i64..50_000_000, len in 0i64..5_000_000,
                                          keep in 1usize..50) {
            let t = timing(&Spec::Every(Duration::from_millis(every as u64)), anchor).unwrap();
            let to = from + len;
            let (due, dropped) = t.due(from, to, keep);
            // Brute force.
            let all: Vec<i64> = (0..).map(|k| anchor + k * every).skip_while(|&o| o < from)
                .take_while(|&o| o <= to).collect();
            let want = &all[all.len().saturating_sub(keep)..];
            proptest::prop_assert_eq!(&due[..], want);
            proptest::prop_assert_eq!(dropped, all.len() > keep);
        }
    }

    /// Cases per arbitrary-input property (`NEXUSCRM_PROPTEST_CASES`, 2,000 by default).
    fn arbitrary_cases() -> proptest::test_runner::Config {
        proptest::test_runner::Config::with_cases(
            nexuscrm_persistence::testing::arbitrary_case_count(),
        )
    }

    proptest::proptest! {
        #![proptest_config(arbitrary_cases())]

        /// Any text: a duration or a clear refusal, never a panic, never beyond the bound.
        #[test]
        fn parse_duration_never_panics_and_stays_bounded(s in ".{0,40}") {
            match parse_duration(&s) {
                Ok(d) => proptest::prop_assert!(d <= MAX_DURATION),
                Err(e) => proptest::prop_assert!(!e.is_empty() && e.len() < 200, "{e}"),
            }
        }

        /// Numbers with units round-trip through format_duration.
        #[test]
        fn arbitrary_durations_round_trip(n in 0u64..10_000, unit in proptest::sample::select(vec!["ms", "s", "m", "h"])) {
            let text = format!("{n}{unit}");
            if let Ok(d) = parse_duration(&text) {
                proptest::prop_assert_eq!(parse_duration(&format_duration(d)).unwrap(), d);
            }
        }

        /// Any cron-shaped text in any zone text: a timing or a clear refusal, never a panic,
        /// and a timing's next occurrence is after its input.
        #[test]
        fn cron_specs_with_zones_never_panic(
            fields in proptest::collection::vec("[0-9*/,LW#?A-Z-]{1,6}", 0..8),
            zone in proptest::sample::select(vec!["UTC", "America/New_York", "Europe/Berlin", "Asia/Kolkata", "Nowhere/City", "", "+05:00"]),
            anchor in 0i64..4_000_000_000_000,
        ) {
            let spec = Spec::cron(fields.join(" "), zone);
            match timing(&spec, anchor) {
                Ok(t) => {
                    if let Some(next) = t.next_after(anchor) {
                        proptest::prop_assert!(next > anchor);
                    }
                }
                Err(e) => proptest::prop_assert!(!e.is_empty()),
            }
        }

        /// Any policy name: one of the three or a clear refusal.
        #[test]
        fn misfire_policies_parse_or_refuse(name in ".{0,20}", max in 0u32..10_000) {
            if let Err(e) = MisfirePolicy::parse(&name, max) {
                proptest::prop_assert!(!e.is_empty());
            }
        }
    }
}

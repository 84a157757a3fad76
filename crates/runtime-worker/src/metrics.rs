//! `/metrics` as OpenMetrics text, encoded by `prometheus-client`.
//!
//! The figures live where they are made: the controllers' lock-free counters and histograms
//! (read through each [`Snapshot`]) and the families' cached domain observations. A scrape reads
//! them once and hands them to a [`Collector`] that encodes them, so nothing is counted twice
//! and no value is kept in a second registry that could drift from the controller's own.

use std::time::Duration;

use nexuscrm_worker::{CLAIM_LATENCY_BOUNDS, ClaimLatency, Histogram, Snapshot};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

use crate::admin::Gauges;

/// The content type of [`render`]'s output.
pub(crate) const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// One family's figures at scrape time.
#[derive(Debug)]
pub(crate) struct Reading {
    /// The family label.
    pub(crate) family: String,
    /// Its controller's counters.
    pub(crate) snapshot: Snapshot,
    /// Its domain observations and their age, when they could be read.
    pub(crate) observed: Option<(Gauges, Duration)>,
}

/// A per-family counter: OpenMetrics name (the encoder adds `_total`), help, value.
type CounterOf = (&'static str, &'static str, fn(&Snapshot) -> u64);

/// Every per-family counter, under the names the hand-written exporter used.
const COUNTERS: &[CounterOf] = &[
    ("nexuscrm_worker_runs", "Controller runs started.", |s| {
        s.runs
    }),
    ("nexuscrm_worker_claim_calls", "Source claim calls.", |s| {
        s.claim_calls
    }),
    (
        "nexuscrm_worker_claim_capacity_asked",
        "Slots asked for, summed over claims.",
        |s| s.claim_capacity_asked,
    ),
    (
        "nexuscrm_worker_claims_empty",
        "Claims that returned no attempt.",
        |s| s.claims_empty,
    ),
    (
        "nexuscrm_worker_claims_full",
        "Claims that filled every slot asked for.",
        |s| s.claims_full,
    ),
    (
        "nexuscrm_worker_attempts_claimed",
        "Attempts returned by claims.",
        |s| s.attempts_claimed,
    ),
    (
        "nexuscrm_worker_attempts_completed",
        "Attempts that finished.",
        |s| s.attempts_completed,
    ),
    (
        "nexuscrm_worker_attempts_failed",
        "Attempts that returned an error or panicked.",
        |s| s.attempts_failed,
    ),
    (
        "nexuscrm_worker_next_work_at_calls",
        "Source next_work_at calls.",
        |s| s.next_work_at_calls,
    ),
    ("nexuscrm_worker_wakes_received", "Wakes received.", |s| {
        s.wakes_received
    }),
    (
        "nexuscrm_worker_wakes_coalesced",
        "Wakes absorbed by a pending claim turn.",
        |s| s.wakes_coalesced,
    ),
    (
        "nexuscrm_worker_timers_armed",
        "Exact due timers armed.",
        |s| s.timers_armed,
    ),
    (
        "nexuscrm_worker_timers_fired",
        "Exact due timers fired.",
        |s| s.timers_fired,
    ),
    (
        "nexuscrm_worker_overdue_suppressed",
        "Already-due answers not armed (empty-loop guard).",
        |s| s.overdue_suppressed,
    ),
    (
        "nexuscrm_worker_due_during_claim",
        "Due times that fell due during a claim and were claimed again.",
        |s| s.due_during_claim,
    ),
    (
        "nexuscrm_worker_generation_changes",
        "Generation changes observed.",
        |s| s.generation_changes,
    ),
    (
        "nexuscrm_worker_generation_losses",
        "Generation probe losses.",
        |s| s.generation_losses,
    ),
];

/// Every per-family gauge read from the controller.
const CONTROLLER_GAUGES: &[CounterOf] = &[
    (
        "nexuscrm_worker_ready",
        "1 when the controller reported Ready and is not poisoned.",
        |s| u64::from(s.ready),
    ),
    (
        "nexuscrm_worker_poisoned",
        "1 when the controller is poisoned.",
        |s| u64::from(s.poisoned.is_some()),
    ),
    (
        "nexuscrm_worker_in_flight",
        "Attempts executing now.",
        |s| s.in_flight as u64,
    ),
    ("nexuscrm_worker_capacity", "Configured capacity.", |s| {
        s.capacity as u64
    }),
];

/// The domain-observation gauges, by name (values come from the families' stores).
const OBSERVATION_GAUGES: &[(&str, &str)] = &[
    (
        "nexuscrm_observations_age_seconds",
        "Age of the family's domain observations below (read at most every 10 s, each count \
         capped at 100000).",
    ),
    ("nexuscrm_queue_jobs", "Jobs by state (domain observation)."),
    (
        "nexuscrm_queue_eligible",
        "Jobs eligible now (domain observation).",
    ),
    (
        "nexuscrm_queue_oldest_eligible_age_seconds",
        "Age of the oldest eligible job (domain observation).",
    ),
    (
        "nexuscrm_flow_schedules",
        "Schedules by state (domain observation).",
    ),
    (
        "nexuscrm_flow_runs",
        "Flow runs reserved (domain observation).",
    ),
    (
        "nexuscrm_flow_oldest_due_age_seconds",
        "How late the most overdue enabled schedule is (domain observation).",
    ),
    (
        "nexuscrm_paused_steps",
        "Paused flow steps by state (domain observation).",
    ),
    (
        "nexuscrm_paused_oldest_uncertain_age_seconds",
        "How long the oldest uncertain step has waited for a person (domain observation).",
    ),
    (
        "nexuscrm_formula_stale_records",
        "Records waiting for (re)derivation of their formula values (domain observation).",
    ),
    (
        "nexuscrm_formula_oldest_stale_age_seconds",
        "How long the oldest unclaimed stale record has waited (domain observation).",
    ),
    (
        "nexuscrm_formula_records_with_errors",
        "Records with at least one formula evaluation error (domain observation).",
    ),
    (
        "nexuscrm_audit_undelivered_events",
        "Audit events committed and not yet in the sink (domain observation).",
    ),
    (
        "nexuscrm_audit_delivery_lag_seconds",
        "Age of the oldest undelivered audit event, 0 when none waits (domain observation).",
    ),
];

/// A histogram per family: name, help, its buckets `(upper bound, count)` (not cumulative; the
/// last bound is `f64::MAX`, encoded as `+Inf`), sum and count.
type HistogramOf = (&'static str, &'static str, fn(&Snapshot) -> Buckets);

struct Buckets {
    buckets: Vec<(f64, u64)>,
    sum: f64,
    count: u64,
}

fn claim_latency(l: &ClaimLatency) -> Buckets {
    let bounds = CLAIM_LATENCY_BOUNDS
        .iter()
        .map(Duration::as_secs_f64)
        .chain(std::iter::once(f64::MAX));
    Buckets {
        buckets: bounds.zip(l.buckets.iter().copied()).collect(),
        sum: l.sum.as_secs_f64(),
        count: l.count(),
    }
}

fn histogram(h: &Histogram) -> Buckets {
    let bounds = h
        .bounds
        .iter()
        .map(|b| h.scaled(*b))
        .chain(std::iter::once(f64::MAX));
    let mut buckets: Vec<(f64, u64)> = bounds.zip(h.buckets.iter().copied()).collect();
    if buckets.is_empty() {
        // A reading with no buckets (a default snapshot) still has its `+Inf` bucket.
        buckets.push((f64::MAX, 0));
    }
    Buckets {
        buckets,
        sum: h.scaled(h.sum),
        count: h.count(),
    }
}

const HISTOGRAMS: &[HistogramOf] = &[
    (
        "nexuscrm_worker_claim_latency_seconds",
        "Claim round trips (issue to answer).",
        |s| claim_latency(&s.claim_latency),
    ),
    (
        "nexuscrm_worker_claim_batch_size",
        "Attempts returned per successful claim.",
        |s| histogram(&s.claim_batch),
    ),
    (
        "nexuscrm_worker_attempt_duration_seconds",
        "How long attempts ran, from spawn until they returned or panicked.",
        |s| histogram(&s.attempt_duration),
    ),
    (
        "nexuscrm_worker_due_lateness_seconds",
        "How long after an exact due time the controller issued its claim (timer, scheduling \
         and claim cooldown; the store's own commit comes on top).",
        |s| histogram(&s.due_lateness),
    ),
];

#[derive(Debug)]
struct Readings(Vec<Reading>);

/// Telemetry's own figures (not per family): best-effort counts, drops by reason.
#[derive(Debug)]
struct TelemetryFigures(nexuscrm_telemetry::TelemetryReport);

impl Collector for TelemetryFigures {
    fn encode(&self, mut e: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let r = &self.0;
        {
            let mut m = e.encode_descriptor(
                "telemetry_dropped",
                "Telemetry events dropped, by reason (best-effort: overflow, exporter_error, \
                 shutdown, crash, no_exporter).",
                None,
                MetricType::Counter,
            )?;
            for (reason, n) in r.dropped {
                let labels = [
                    ("family", nexuscrm_telemetry::FAMILY),
                    ("reason", reason.as_str()),
                ];
                m.encode_family(&labels)?
                    .encode_counter::<NoLabelSet, _, u64>(&n, None)?;
            }
        }
        for (name, help, n) in [
            (
                "telemetry_emitted",
                "Telemetry events offered to the buffer (best-effort).",
                r.emitted,
            ),
            (
                "telemetry_exported",
                "Telemetry events in batches the exporter accepted (best-effort: never a \
                 complete count of usage).",
                r.exported,
            ),
        ] {
            e.encode_descriptor(name, help, None, MetricType::Counter)?
                .encode_family(&[("family", nexuscrm_telemetry::FAMILY)])?
                .encode_counter::<NoLabelSet, _, u64>(&n, None)?;
        }
        e.encode_descriptor(
            "telemetry_pending_events",
            "Telemetry events buffered or being exported now.",
            None,
            MetricType::Gauge,
        )?
        .encode_family(&[("family", nexuscrm_telemetry::FAMILY)])?
        .encode_gauge(&(r.pending as i64))?;
        Ok(())
    }
}

impl Collector for Readings {
    fn encode(&self, mut e: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        for (name, help, value) in COUNTERS {
            let mut m = e.encode_descriptor(name, help, None, MetricType::Counter)?;
            for r in &self.0 {
                let labels = [("family", r.family.as_str())];
                m.encode_family(&labels)?
                    .encode_counter::<NoLabelSet, _, u64>(&value(&r.snapshot), None)?;
            }
        }
        {
            let mut m = e.encode_descriptor(
                "nexuscrm_worker_reconciles",
                "Reconciliations by cause.",
                None,
                MetricType::Counter,
            )?;
            for r in &self.0 {
                let c = r.snapshot.reconciles;
                for (cause, n) in [
                    ("startup", c.startup),
                    ("requested", c.requested),
                    ("generation_change", c.generation_change),
                    ("generation_loss", c.generation_loss),
                    ("backstop", c.backstop),
                ] {
                    let labels = [("family", r.family.as_str()), ("cause", cause)];
                    m.encode_family(&labels)?
                        .encode_counter::<NoLabelSet, _, u64>(&n, None)?;
                }
            }
        }
        for (name, help, value) in HISTOGRAMS {
            let mut m = e.encode_descriptor(name, help, None, MetricType::Histogram)?;
            for r in &self.0 {
                let b = value(&r.snapshot);
                let labels = [("family", r.family.as_str())];
                m.encode_family(&labels)?
                    .encode_histogram::<NoLabelSet>(b.sum, b.count, &b.buckets, None)?;
            }
        }
        for (name, help, value) in CONTROLLER_GAUGES {
            let mut m = e.encode_descriptor(name, help, None, MetricType::Gauge)?;
            for r in &self.0 {
                let labels = [("family", r.family.as_str())];
                m.encode_family(&labels)?
                    .encode_gauge(&value(&r.snapshot))?;
            }
        }
        for (name, help) in OBSERVATION_GAUGES {
            let mut m = e.encode_descriptor(name, help, None, MetricType::Gauge)?;
            for r in &self.0 {
                let Some((gauges, age)) = &r.observed else {
                    continue;
                };
                if *name == "nexuscrm_observations_age_seconds" {
                    let labels = [("family", r.family.as_str())];
                    m.encode_family(&labels)?.encode_gauge(&age.as_secs_f64())?;
                    continue;
                }
                for (_, state, v) in gauges.iter().filter(|(n, _, _)| n == name) {
                    match state {
                        Some(state) => {
                            let labels = [("family", r.family.as_str()), ("state", state)];
                            m.encode_family(&labels)?.encode_gauge(v)?;
                        }
                        None => {
                            let labels = [("family", r.family.as_str())];
                            m.encode_family(&labels)?.encode_gauge(v)?;
                        }
                    }
                }
            }
        }
        Ok(())
    }
}

/// The OpenMetrics text of `readings` and of telemetry's figures (ends with `# EOF`).
pub(crate) fn render(
    readings: Vec<Reading>,
    telemetry: Option<nexuscrm_telemetry::TelemetryReport>,
) -> String {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(Readings(readings)));
    if let Some(t) = telemetry {
        registry.register_collector(Box::new(TelemetryFigures(t)));
    }
    let mut out = String::new();
    // Writing into a String cannot fail; a collector error would be a bug in this module.
    if let Err(e) = prometheus_client::encoding::text::encode(&mut out, &registry) {
        out = format!("# encoding the metrics failed: {e}\n# EOF\n");
    }
    out
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use nexuscrm_worker::Snapshot;

    use super::*;

    fn parse(text: &str) -> prometheus_parse::Scrape {
        prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_owned()))).unwrap()
    }

    #[test]
    fn the_output_is_open_metrics_that_a_prometheus_parser_reads_back() {
        let mut snapshot = Snapshot::default();
        snapshot.claim_calls = 7;
        snapshot.ready = true;
        snapshot.capacity = 4;
        snapshot.claim_latency.buckets[0] = 2; // two claims <= 1 ms
        snapshot.claim_latency.buckets[3] = 1; // one <= 10 ms
        snapshot.claim_latency.sum = Duration::from_millis(9);
        snapshot.reconciles.startup = 1;
        let gauges: Gauges = vec![
            ("nexuscrm_queue_jobs", Some("pending"), 3.0),
            ("nexuscrm_queue_eligible", None, 2.0),
        ];
        let telemetry = nexuscrm_telemetry::Telemetry::disabled();
        telemetry.emit(nexuscrm_telemetry::UsageEvent::new(
            "acme",
            "bulk.rows_applied",
            5,
        ));
        telemetry.emit(nexuscrm_telemetry::UsageEvent::new(
            "acme",
            "bulk.rows_applied",
            6,
        ));
        let text = render(
            vec![Reading {
                family: "bulk".into(),
                snapshot,
                observed: Some((gauges, Duration::from_millis(1500))),
            }],
            Some(telemetry.report()),
        );
        assert!(text.ends_with("# EOF\n"), "{text}");
        assert!(text.contains("# TYPE nexuscrm_worker_claim_calls counter"));
        let scrape = parse(&text);
        let value = |metric: &str, labels: &[(&str, &str)]| -> Option<f64> {
            scrape
                .samples
                .iter()
                .find(|s| {
                    s.metric == metric && labels.iter().all(|(k, v)| s.labels.get(k) == Some(v))
                })
                .map(|s| match &s.value {
                    prometheus_parse::Value::Counter(v)
                    | prometheus_parse::Value::Gauge(v)
                    | prometheus_parse::Value::Untyped(v) => *v,
                    other => panic!("{metric}: {other:?}"),
                })
        };
        // Counters keep their names (OpenMetrics adds `_total` to the sample).
        assert_eq!(
            value("nexuscrm_worker_claim_calls_total", &[("family", "bulk")]),
            Some(7.0)
        );
        assert_eq!(
            value(
                "nexuscrm_worker_reconciles_total",
                &[("family", "bulk"), ("cause", "startup")]
            ),
            Some(1.0)
        );
        assert_eq!(
            value("nexuscrm_worker_ready", &[("family", "bulk")]),
            Some(1.0)
        );
        assert_eq!(
            value(
                "nexuscrm_queue_jobs",
                &[("family", "bulk"), ("state", "pending")]
            ),
            Some(3.0)
        );
        assert_eq!(value("nexuscrm_queue_eligible", &[]), Some(2.0));
        // Telemetry's drops, by reason; every reason is present, zero or not.
        assert_eq!(
            value("telemetry_dropped_total", &[("reason", "no_exporter")]),
            Some(2.0)
        );
        assert_eq!(
            value("telemetry_dropped_total", &[("reason", "overflow")]),
            Some(0.0)
        );
        assert_eq!(value("telemetry_emitted_total", &[]), Some(2.0));
        assert_eq!(value("telemetry_exported_total", &[]), Some(0.0));
        assert_eq!(value("telemetry_pending_events", &[]), Some(0.0));
        assert_eq!(value("nexuscrm_observations_age_seconds", &[]), Some(1.5));
        // The histograms, with cumulative buckets up to +Inf.
        let histograms: HashMap<&str, &Vec<prometheus_parse::HistogramCount>> = scrape
            .samples
            .iter()
            .filter_map(|s| match &s.value {
                prometheus_parse::Value::Histogram(h) => Some((s.metric.as_str(), h)),
                _ => None,
            })
            .collect();
        for name in [
            "nexuscrm_worker_claim_latency_seconds",
            "nexuscrm_worker_claim_batch_size",
            "nexuscrm_worker_attempt_duration_seconds",
            "nexuscrm_worker_due_lateness_seconds",
        ] {
            assert!(histograms.contains_key(name), "{name} in {text}");
        }
        let latency = histograms["nexuscrm_worker_claim_latency_seconds"];
        let at = |le: f64| {
            latency
                .iter()
                .find(|b| b.less_than == le || (b.less_than - le).abs() < 1e-9)
                .map(|b| b.count)
        };
        assert_eq!(at(0.001), Some(2.0));
        assert_eq!(at(0.005), Some(2.0));
        assert_eq!(at(0.01), Some(3.0));
        assert_eq!(at(f64::INFINITY), Some(3.0));
        assert!(text.contains("nexuscrm_worker_claim_latency_seconds_count{family=\"bulk\"} 3"));
        assert!(text.contains("nexuscrm_worker_claim_latency_seconds_sum{family=\"bulk\"} 0.009"));
    }
}

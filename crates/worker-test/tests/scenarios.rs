//! The conformance scenarios pass against the kit's reference memory family.

use nexuscrm_worker_test::memory::MemoryScenarios;
use nexuscrm_worker_test::scenarios;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_conformance_scenario_passes_against_the_memory_family() {
    let report = scenarios::run_all(&MemoryScenarios).await;
    println!("{report}");
    report.assert_all_passed();
}

//! The common suite over the verbs transport. These tests need an RDMA device: they run on
//! soft-RoCE inside the project's VM (`scripts/vm-test.sh`, part of `scripts/test.sh`), with
//! `--ignored`; on a machine without RDMA `cargo test` lists them as ignored.

mod common;

use common::Net;

macro_rules! suite_over_verbs {
    ($($name:ident),* $(,)?) => {$(
        #[test]
        #[ignore = "needs an RDMA device: runs on soft-RoCE via scripts/vm-test.sh"]
        fn $name() {
            common::suite::$name(&Net::verbs_from_env());
        }
    )*};
}

suite_over_verbs!(
    processes_exchange_verified_messages_at_all_sizes,
    connect_to_name_nobody_listens_on_is_refused_at_once,
    connect_to_silent_listener_times_out_within_its_timeout,
    second_listener_on_same_name_is_addr_in_use,
    reject_carries_private_data_both_ways,
    accept_private_data_reaches_the_client,
    oversized_private_data_is_invalid_and_nothing_is_sent,
    peer_killed_mid_stream_is_reported_within_one_second,
    slow_receiver_holds_sender_back_and_loses_nothing,
    receive_too_small_fails_both_sides_with_length_errors,
    bad_posts_return_clear_errors_and_post_nothing,
    disconnect_flushes_and_reports_on_both_sides,
    completion_fd_is_readable_exactly_while_completions_are_queued,
    slot_is_free_once_its_completion_is_seen,
    idle_connection_stays_up_and_reports_nothing,
    sleepers_wake_for_late_completions_in_both_progress_modes,
    two_threads_polling_one_queue_take_each_completion_once,
    connect_close_cycles_leak_nothing,
);

/// A connect to an address no route reaches fails with its own status, within the timeout.
/// (198.18.99.0/24 is on no interface of the VM, so nothing is ever sent.)
#[test]
#[ignore = "needs an RDMA device: runs on soft-RoCE via scripts/vm-test.sh"]
fn connect_to_unroutable_address_is_unreachable_within_timeout() {
    use rdmabridge::{CompletionQueue, ConnOptions, Context, Error};
    use std::time::{Duration, Instant};
    let _ = Net::verbs_from_env(); // only meaningful inside the VM
    let ctx = Context::new().unwrap();
    let cq = CompletionQueue::new().unwrap();
    let opts = ConnOptions {
        timeout: Some(Duration::from_secs(2)),
        ..Default::default()
    };
    let t = Instant::now();
    let r = ctx.connect("rdma://198.18.99.1:7471", &cq, &opts);
    assert!(matches!(r, Err(Error::Unreachable(_))), "{r:?}");
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
}

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
    connect_close_cycles_leak_nothing,
);

//! Resource-leak test over shm, alone in its own test binary so no other test opens
//! descriptors or mappings while it counts them.

mod common;

#[test]
fn connect_close_cycles_leak_nothing() {
    common::suite::connect_close_cycles_leak_nothing(&common::Net::Shm);
}

//! The batcher's unit tests: batching under load, the spacing and `FILL`, one error per item,
//! the fallback to unary calls.

use std::sync::atomic::AtomicUsize;

use super::*;

/// A batcher over an echo server that records the size of every call it receives.
fn echo(
    sizes: Arc<Mutex<Vec<usize>>>,
    gate: Arc<tokio::sync::Semaphore>,
    batch_rpc: bool,
) -> Batcher<u32, u32> {
    echo_spaced(sizes, gate, batch_rpc, SPACING)
}

/// [`echo`] with `spacing` between batches.
fn echo_spaced(
    sizes: Arc<Mutex<Vec<usize>>>,
    gate: Arc<tokio::sync::Semaphore>,
    batch_rpc: bool,
    spacing: Duration,
) -> Batcher<u32, u32> {
    let batch_sizes = sizes.clone();
    let batch_gate = gate.clone();
    Batcher::spaced(
        Box::new(move |requests: Vec<u32>| {
            let sizes = batch_sizes.clone();
            let gate = batch_gate.clone();
            Box::pin(async move {
                if !batch_rpc {
                    return Err(Status::unimplemented("no batch rpc"));
                }
                let _permit = gate.acquire().await.map_err(|_| Status::cancelled(""))?;
                sizes.lock().expect("the test's lock").push(requests.len());
                Ok(requests
                    .into_iter()
                    .map(|r| {
                        if r == 0 {
                            Err(Status::invalid_argument("zero"))
                        } else {
                            Ok(r * 10)
                        }
                    })
                    .collect())
            })
        }),
        Box::new(move |request: u32| {
            let sizes = sizes.clone();
            let gate = gate.clone();
            Box::pin(async move {
                let _permit = gate.acquire().await.map_err(|_| Status::cancelled(""))?;
                sizes.lock().expect("the test's lock").push(1);
                if request == 0 {
                    return Err(Status::invalid_argument("zero"));
                }
                Ok(request * 10)
            })
        }),
        spacing,
    )
}

/// An unspaced batcher (a service of the same cluster) sends what arrived while a call was
/// in flight as soon as that call is answered, without waiting for [`SPACING`].
#[tokio::test(start_paused = true)]
async fn an_unspaced_batcher_sends_the_next_batch_when_the_previous_is_answered() {
    let sizes = Arc::new(Mutex::new(Vec::new()));
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let batcher = echo_spaced(sizes.clone(), gate.clone(), true, Duration::ZERO);
    let start = Instant::now();
    let mut calls = vec![spawn_call(&batcher, 1)];
    // The first call leaves alone and waits at the gate; three more queue meanwhile.
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    calls.extend((2..=4).map(|i| spawn_call(&batcher, i)));
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    gate.add_permits(1_000);
    for (i, call) in (1..=4).zip(calls) {
        assert_eq!(call.await.expect("the call task"), i * 10);
    }
    assert_eq!(*sizes.lock().expect("the test's lock"), vec![1, 3]);
    assert!(
        start.elapsed() < SPACING,
        "the second batch waited for the spacing: {:?}",
        start.elapsed()
    );
}

#[tokio::test]
async fn a_lone_call_goes_at_once_and_calls_under_load_leave_together() {
    let alone = Arc::new(Mutex::new(Vec::new()));
    let open = Arc::new(tokio::sync::Semaphore::new(1_000));
    assert_eq!(
        echo(alone.clone(), open, true)
            .call(9)
            .await
            .expect("the call"),
        90
    );
    assert_eq!(
        *alone.lock().expect("the test's lock"),
        vec![1],
        "a lone call is sent as the unary call"
    );

    let sizes = Arc::new(Mutex::new(Vec::new()));
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let batcher = echo(sizes.clone(), gate.clone(), true);
    let calls: Vec<_> = (1..=50_u32)
        .map(|i| {
            let b = batcher.clone();
            tokio::spawn(async move { b.call(i).await })
        })
        .collect();
    // Let every call queue while the first IN_FLIGHT sends wait at the gate.
    tokio::task::yield_now().await;
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    gate.add_permits(1_000);
    for (i, call) in (1..=50_u32).zip(calls) {
        assert_eq!(
            call.await.expect("the call task").expect("the call"),
            i * 10
        );
    }
    let sizes = sizes.lock().expect("the test's lock").clone();
    assert_eq!(sizes.iter().sum::<usize>(), 50, "{sizes:?}");
    assert!(
        sizes.len() <= IN_FLIGHT + 2,
        "50 calls made while {IN_FLIGHT} were in flight leave in a few batches: {sizes:?}"
    );
}

/// An [`echo`] batcher that answers at once, and the sizes of the calls it receives.
fn open_echo() -> (Arc<Mutex<Vec<usize>>>, Batcher<u32, u32>) {
    let sizes = Arc::new(Mutex::new(Vec::new()));
    let batcher = echo(
        sizes.clone(),
        Arc::new(tokio::sync::Semaphore::new(1_000)),
        true,
    );
    (sizes, batcher)
}

/// Calls `batcher` with `value` from a task of its own.
fn spawn_call(batcher: &Batcher<u32, u32>, value: u32) -> tokio::task::JoinHandle<u32> {
    let batcher = batcher.clone();
    tokio::spawn(async move { batcher.call(value).await.expect("the call") })
}

#[tokio::test(start_paused = true)]
async fn batches_to_a_busy_server_are_spaced_and_a_quiet_one_is_called_at_once() {
    let (sizes, batcher) = open_echo();
    let start = Instant::now();
    assert_eq!(batcher.call(1).await.expect("the call"), 10);
    assert!(
        start.elapsed() < SPACING,
        "a quiet server is called at once"
    );

    // Three calls within the spacing after the first leave together, when it has passed.
    let mut calls = Vec::new();
    for i in 2..=4 {
        tokio::time::sleep(Duration::from_millis(10)).await;
        calls.push(spawn_call(&batcher, i));
    }
    for (i, call) in (2..=4).zip(calls) {
        assert_eq!(call.await.expect("the call task"), i * 10);
    }
    assert!(start.elapsed() >= SPACING, "they waited for the spacing");
    assert_eq!(*sizes.lock().expect("the test's lock"), vec![1, 3]);

    // A call long after the last batch goes at once again.
    tokio::time::sleep(SPACING * 3).await;
    let quiet = Instant::now();
    assert_eq!(batcher.call(5).await.expect("the call"), 50);
    assert!(quiet.elapsed() < SPACING);
    assert_eq!(*sizes.lock().expect("the test's lock"), vec![1, 3, 1]);
}

#[tokio::test(start_paused = true)]
async fn a_full_batch_does_not_wait_for_the_spacing() {
    let (sizes, batcher) = open_echo();
    assert_eq!(batcher.call(1).await.expect("the call"), 10);
    let start = Instant::now();
    let calls: Vec<_> = (1..=FILL as u32).map(|i| spawn_call(&batcher, i)).collect();
    for (i, call) in (1..=FILL as u32).zip(calls) {
        assert_eq!(call.await.expect("the call task"), i * 10);
    }
    assert!(
        start.elapsed() < SPACING,
        "{FILL} waiting requests leave at once: {:?}",
        start.elapsed()
    );
    assert_eq!(*sizes.lock().expect("the test's lock"), vec![1, FILL]);
}

#[tokio::test]
async fn each_item_gets_its_own_error() {
    let sizes = Arc::new(Mutex::new(Vec::new()));
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let batcher = echo(sizes.clone(), gate.clone(), true);
    let calls: Vec<_> = [3_u32, 0, 4, 0, 5]
        .into_iter()
        .map(|i| {
            let b = batcher.clone();
            tokio::spawn(async move { b.call(i).await })
        })
        .collect();
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    gate.add_permits(1_000);
    let mut got = Vec::new();
    for call in calls {
        got.push(call.await.expect("the call task").map_err(|s| s.code()));
    }
    assert_eq!(
        got,
        vec![
            Ok(30),
            Err(Code::InvalidArgument),
            Ok(40),
            Err(Code::InvalidArgument),
            Ok(50)
        ]
    );
}

#[tokio::test]
async fn a_server_without_the_batch_rpc_is_called_once_per_request_after_the_first_refusal() {
    let sizes = Arc::new(Mutex::new(Vec::new()));
    let gate = Arc::new(tokio::sync::Semaphore::new(1_000));
    let batcher = echo(sizes.clone(), gate.clone(), false);
    let refused = AtomicUsize::new(0);
    // Enough concurrent calls that some leave as a batch, which the server refuses.
    let results = futures::future::join_all((1..=20_u32).map(|i| batcher.call(i))).await;
    for (i, result) in (1..=20_u32).zip(results) {
        match result {
            Ok(v) => assert_eq!(v, i * 10),
            Err(s) => {
                assert_eq!(s.code(), Code::Unimplemented);
                refused.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
    assert!(
        refused.load(Ordering::Relaxed) > 0,
        "the first batch was refused"
    );
    assert_eq!(
        batcher.call(7).await.expect("the call"),
        70,
        "later calls go unary"
    );
    assert!(format!("{batcher:?}").contains("unary_only: true"));
}

#[test]
fn an_oversized_batch_is_refused_naming_the_field() {
    assert!(check_len(MAX_ITEMS).is_ok());
    let err = check_len(MAX_ITEMS + 1).expect_err("too many");
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().contains("requests"), "{}", err.message());
}

#[test]
fn item_errors_round_trip() {
    let status = from_item_error(to_item_error(&Status::permission_denied("not yours")));
    assert_eq!(status.code(), Code::PermissionDenied);
    assert_eq!(status.message(), "not yours");
    assert_eq!(
        from_item_error(ItemError {
            code: 999,
            message: String::new()
        })
        .code(),
        Code::Unknown
    );
}

#[test]
fn results_travel_in_their_oneof_and_come_back_in_order() {
    let sent = vec![
        Ok(RelayResponse::default()),
        Err(Status::failed_precondition("not introduced")),
    ];
    let back = unpack(relay_results(sent), |r| match r.result {
        Some(relay_result::Result::Response(response)) => Some(Ok(response)),
        Some(relay_result::Result::Error(error)) => Some(Err(error)),
        None => None,
    });
    assert!(back[0].is_ok());
    let err = back[1].as_ref().expect_err("the second failed");
    assert_eq!(err.code(), Code::FailedPrecondition);
    assert_eq!(err.message(), "not introduced");
    let submitted = submit_results(vec![Err(Status::invalid_argument("bad"))]);
    assert!(matches!(
        &submitted[0].result,
        Some(submit_network_config_result::Result::Error(e)) if e.code == Code::InvalidArgument as i32
    ));
    let empty = unpack(vec![RelayResult { result: None }], |r: RelayResult| {
        r.result.map(|_| Ok::<_, ItemError>(()))
    });
    assert_eq!(
        empty[0].as_ref().expect_err("no result").code(),
        Code::Internal
    );
}

#[tokio::test]
async fn items_are_served_in_order() {
    let results = serve(vec![3_u32, 1, 2], |i| async move {
        tokio::time::sleep(std::time::Duration::from_millis(u64::from(i))).await;
        Ok::<_, Status>(i)
    })
    .await;
    let got: Vec<u32> = results.into_iter().map(|r| r.expect("served")).collect();
    assert_eq!(got, vec![3, 1, 2]);
}

/// Items finish one by one, as their destinations answer: each answer polls its own item,
/// not every item still waiting (which made a batch of n items cost n²/2 polls, each
/// entering the item's span).
#[tokio::test(start_paused = true)]
async fn an_item_is_polled_when_it_is_woken_not_when_another_is() {
    const ITEMS: u64 = 30;
    let polls = Arc::new(AtomicUsize::new(0));
    let results = serve((1..=ITEMS).collect(), |i| {
        let polls = polls.clone();
        let mut sleep = Box::pin(tokio::time::sleep(Duration::from_millis(i)));
        std::future::poll_fn(move |cx| {
            polls.fetch_add(1, Ordering::Relaxed);
            sleep.as_mut().poll(cx).map(|()| Ok::<_, Status>(i))
        })
    })
    .await;
    let got: Vec<u64> = results.into_iter().map(|r| r.expect("served")).collect();
    assert_eq!(got, (1..=ITEMS).collect::<Vec<_>>());
    // Once when started and once when its own timer fires (joining every item on every
    // wake polls 30 items 495 times).
    let polls = polls.load(Ordering::Relaxed);
    assert!(
        polls <= 2 * ITEMS as usize,
        "{polls} polls for {ITEMS} items"
    );
}

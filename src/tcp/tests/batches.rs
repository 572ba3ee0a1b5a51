//! Batched completions over TCP (issue 16, item 3): a batch is one frame, split at the frame
//! bound and the wire limit, and a worker dying mid-batch delivers nothing of it.

use super::*;
use crate::tcp::frame;

/// Every `Completed` list the leader receives within `within`, until `want` completions came.
fn completed_lists(leader: &TcpLeader, want: usize, within: Duration) -> Vec<Vec<Completion>> {
    let mut lists = Vec::new();
    let mut n = 0;
    while n < want {
        let list = recv_from(leader, within, |_, m| match m {
            WorkerMessage::Completed(list) => Some(list),
            other => panic!("unexpected {other:?}"),
        })
        .unwrap_or_else(|| panic!("{n} of {want} completions arrived"));
        n += list.len();
        lists.push(list);
    }
    lists
}

#[test]
fn a_batch_of_completions_is_one_frame_delivered_as_one_message_in_order() {
    let leader = TcpLeader::bind(any_port(), 1, None).unwrap();
    let w = TcpWorker::connect(leader.local_addr(), 0, 1, None, LONG).unwrap();
    let list: Vec<Completion> = (0..1000u64)
        .rev()
        .map(|i| Completion {
            op: OperationId(i),
            failed_dst_blocks: if i % 7 == 0 { vec![i as usize] } else { vec![] },
            error: (i % 7 == 0).then(|| format!("block {i} failed")),
        })
        .collect();
    w.send(WorkerMessage::Completed(list.clone())).unwrap();
    assert_eq!(completed_lists(&leader, list.len(), LONG), vec![list]);
    assert_eq!(w.frames_sent(), 1);
    let got = leader.received();
    assert_eq!(
        (got.completion_frames, got.completions, got.msg_frames),
        (1, 1000, 0)
    );
}

#[test]
fn a_batch_above_the_frame_bound_is_split_and_arrives_whole_in_order() {
    let leader = TcpLeader::bind(any_port(), 1, None).unwrap();
    let w = TcpWorker::connect(leader.local_addr(), 0, 1, None, LONG).unwrap();
    // A small bound: many frames, and one operation whose failed blocks span several.
    w.set_completions_limit(300);
    let mut list: Vec<Completion> = (0..200u64).map(completion).collect();
    list[100].failed_dst_blocks = (0..500).collect();
    list[100].error = Some("disk full".into());
    w.send(WorkerMessage::Completed(list.clone())).unwrap();
    let lists = completed_lists(&leader, list.len(), LONG);
    assert!(lists.len() > 10, "{} messages", lists.len());
    assert_eq!(lists.concat(), list);
    let got = leader.received();
    assert_eq!(got.completion_frames, w.frames_sent());
    assert!(got.completion_frames > lists.len() as u64, "{got:?}");
    assert_eq!(got.completions, 200);
}

#[test]
fn a_batch_above_16_mib_is_split_at_the_wire_limit() {
    let leader = TcpLeader::bind(any_port(), 1, None).unwrap();
    let w = TcpWorker::connect(leader.local_addr(), 0, 1, None, LONG).unwrap();
    // 150 000 × (13 + 4 + 120) bytes ≈ 20.6 MB: two frames of at most 16 MiB.
    let error = "e".repeat(120);
    let list: Vec<Completion> = (0..150_000u64)
        .map(|i| Completion {
            op: OperationId(i),
            failed_dst_blocks: vec![],
            error: Some(error.clone()),
        })
        .collect();
    w.send(WorkerMessage::Completed(list.clone())).unwrap();
    let lists = completed_lists(&leader, list.len(), LONG);
    assert_eq!(lists.len(), 2);
    assert_eq!(lists.concat(), list);
    assert_eq!(w.frames_sent(), 2);
}

#[test]
fn a_worker_dying_mid_batch_delivers_nothing_of_it_and_is_reported_lost() {
    let leader = TcpLeader::bind(any_port(), 3, None).unwrap();
    let addr = leader.local_addr();
    let first = frame::encode_completions(&[completion(1)], frame::MAX_PAYLOAD)
        .unwrap()
        .remove(0);
    // Rank 0: one whole frame, then half of the next one, then gone.
    let mut r0 = raw_worker(addr, 0, 3);
    let second = frame::encode_completions(&[completion(2), completion(3)], frame::MAX_PAYLOAD)
        .unwrap()
        .remove(0);
    r0.write_all(&first).unwrap();
    r0.write_all(&second[..second.len() / 2]).unwrap();
    drop(r0);
    // Rank 1: an operation split over frames, of which only the first arrived.
    let mut r1 = raw_worker(addr, 1, 3);
    let split = frame::encode_completions(
        &[Completion {
            op: OperationId(9),
            failed_dst_blocks: (0..100).collect(),
            error: None,
        }],
        frame::MIN_COMPLETIONS_PAYLOAD,
    )
    .unwrap();
    assert!(split.len() > 1);
    r1.write_all(&split[0]).unwrap();
    drop(r1);
    let mut seen = Vec::new();
    let mut lost = Vec::new();
    while lost.len() < 2 {
        match recv_from(&leader, LONG, |r, m| Some((r, m))) {
            Some((r, WorkerMessage::Completed(list))) => seen.push((r, list)),
            Some((r, WorkerMessage::Disconnected(_))) => lost.push(r),
            other => panic!("unexpected {other:?} (lost so far: {lost:?})"),
        }
    }
    lost.sort();
    assert_eq!(lost, vec![0, 1]);
    // The whole frame arrived; nothing of the partial ones did.
    assert_eq!(seen, vec![(0, vec![completion(1)])]);
    assert!(leader.try_recv().unwrap().is_none());
}

//! The network namespaces `cairn-nemesis --netns` runs on (`netns`): hosts on a bridge,
//! and faults that really cut, drop and slow their packets, then heal. The test runs itself
//! again under `unshare --net` so that the bridge and the hosts go with it; needs root.

use std::process::Command;
use std::time::Duration;

use cairn_integration_tests::netns::{self, Net};
use cairn_integration_tests::processes::ChildGuard;

/// Whether a TCP connection from host `from` to `address` is made within a second.
fn connects(net: &Net, from: usize, address: &str) -> bool {
    let (ip, port) = address.split_once(':').expect("ip:port");
    net.command_in(from, "timeout")
        .args(["1", "bash", "-c", &format!("exec 3<>/dev/tcp/{ip}/{port}")])
        .stderr(std::process::Stdio::null())
        .status()
        .expect("bash in the host")
        .success()
}

/// A listener in host `at` on `port` (the kernel completes the handshakes: nothing accepts).
fn listen(net: &Net, at: usize, port: u16, log: &std::path::Path) -> ChildGuard {
    let ip = &net.placement().nodes[at].0;
    let script = format!(
        "import socket, time\ns = socket.create_server(('{ip}', {port}))\nprint('up', flush=True)\ntime.sleep(600)"
    );
    let mut python = net.command_in(at, "python3");
    python.args(["-c", &script]);
    ChildGuard::spawn("listener", python, log).expect("python3 in the host")
}

fn inside() {
    netns::reexec_in_own_namespace().expect("the namespace's loopback");
    let net = Net::start(3).expect("three hosts");
    let dir = std::env::temp_dir().join(format!("cairn-netns-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let port = cairn_integration_tests::processes::free_port();
    let _l1 = listen(&net, 1, port, &dir.join("l1.log"));
    let _l2 = listen(&net, 2, port, &dir.join("l2.log"));
    let ips: Vec<String> = net
        .placement()
        .nodes
        .iter()
        .map(|(ip, _)| ip.clone())
        .collect();
    let (to1, to2) = (format!("{}:{port}", ips[1]), format!("{}:{port}", ips[2]));
    // The listeners are up once a connection is made (each try times out after 1 s).
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while !(connects(&net, 0, &to1) && connects(&net, 0, &to2)) {
        assert!(
            std::time::Instant::now() < deadline,
            "the listeners never came up"
        );
    }

    // A partition between hosts 0 and 1 cuts 0 -> 1 and leaves 0 -> 2.
    let partition = net.partition(0, 1).expect("partition");
    assert!(
        !connects(&net, 0, &to1),
        "host 0 reached host 1 across the partition"
    );
    assert!(
        connects(&net, 0, &to2),
        "the partition cut host 0 from host 2 too"
    );
    for f in &partition {
        f.heal().expect("heal the partition");
    }
    assert!(
        connects(&net, 0, &to1),
        "host 0 does not reach host 1 after the heal"
    );

    // Host 0 cut off reaches no one; healed, everyone.
    let isolated = net.isolate(0).expect("isolate");
    assert!(
        !connects(&net, 0, &to1) && !connects(&net, 0, &to2),
        "isolated host 0 reached a peer"
    );
    isolated.heal().expect("heal the isolation");
    assert!(connects(&net, 0, &to1) && connects(&net, 0, &to2));

    // Loss and a slow link are rules in the host while in force, gone when healed.
    let rules = |what: &str| {
        let out = net
            .command_in(0, what.split(' ').next().unwrap())
            .args(what.split(' ').skip(1))
            .output()
            .expect("list the host's rules");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let loss = net.loss(0, 25).expect("loss");
    assert!(
        rules("iptables -S INPUT").contains("--probability 0.25"),
        "{}",
        rules("iptables -S INPUT")
    );
    loss.heal().expect("heal the loss");
    assert!(!rules("iptables -S INPUT").contains("statistic"));
    let slow = net.throttle(0, 128).expect("throttle");
    assert!(
        rules("tc qdisc show dev eth0").contains("tbf"),
        "{}",
        rules("tc qdisc show dev eth0")
    );
    assert!(connects(&net, 0, &to1), "a slow link still connects");
    slow.heal().expect("heal the slow link");
    assert!(!rules("tc qdisc show dev eth0").contains("tbf"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn hosts_are_partitioned_isolated_slowed_and_healed() {
    if std::env::var_os(netns::INSIDE).is_some() {
        inside();
        return;
    }
    let status = Command::new("unshare")
        .args(["--net", "--"])
        .arg(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "hosts_are_partitioned_isolated_slowed_and_healed",
            "--nocapture",
        ])
        .env(netns::INSIDE, "1")
        .status()
        .expect("unshare (util-linux) on PATH");
    assert!(
        status.success(),
        "the run in a network namespace of its own failed (it needs root, iproute2, iptables \
         and python3; its output is above): {status}"
    );
}

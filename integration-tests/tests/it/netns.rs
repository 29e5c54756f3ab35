//! The network namespaces `cairn-nemesis --netns` runs on (`netns`): hosts on a bridge,
//! and faults that really cut, drop and slow their packets, then heal. The test runs itself
//! again under `unshare --net` so that the bridge and the hosts go with it; needs root.

use std::process::Command;
use std::time::{Duration, Instant};

use cairn_integration_tests::netns::{self, Net};
use cairn_integration_tests::processes::{ChildGuard, free_port};

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

/// Waits (up to 20 s, a try a second at most) until host `from` connects to `address`.
fn reaches(net: &Net, from: usize, address: &str) -> bool {
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        if connects(net, from, address) {
            return true;
        }
    }
    false
}

/// Sends 64 KiB from host `from` to `address` (the writer may end before it is all sent).
fn send(net: &Net, from: usize, address: &str) {
    let (ip, port) = address.split_once(':').expect("ip:port");
    let script = format!("exec 3<>/dev/tcp/{ip}/{port}; head -c 65536 /dev/zero >&3");
    let _ = net
        .command_in(from, "timeout")
        .args(["10", "bash", "-c", &script])
        .stderr(std::process::Stdio::null())
        .status();
}

/// A listener in host `at` on `port` (the kernel completes the handshakes and buffers what
/// arrives: nothing accepts).
fn listen(net: &Net, at: usize, port: u16, log: &std::path::Path) -> ChildGuard {
    let ip = &net.placement().nodes[at].0;
    let script =
        format!("import socket, time\ns = socket.create_server(('{ip}', {port}))\ntime.sleep(600)");
    let mut python = net.command_in(at, "python3");
    python.args(["-c", &script]);
    ChildGuard::spawn("listener", python, log).expect("python3 in the host")
}

/// What `command` prints in host 0; it must succeed.
fn host0(net: &Net, command: &str) -> String {
    let mut words = command.split(' ');
    let out = net
        .command_in(0, words.next().expect("a program"))
        .args(words)
        .output()
        .expect("run in host 0");
    assert!(
        out.status.success(),
        "`{command}` in host 0 failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The packets host 0's rule containing `what` dropped.
fn dropped(net: &Net, what: &str) -> u64 {
    let rules = host0(net, "iptables -w -L INPUT -v -x -n");
    let line = rules
        .lines()
        .find(|l| l.contains(what))
        .unwrap_or_else(|| panic!("no rule with {what}:\n{rules}"));
    line.split_whitespace()
        .next()
        .and_then(|n| n.parse().ok())
        .expect("a packet count")
}

fn inside() {
    netns::reexec_in_own_namespace().expect("the namespace's loopback");
    let net = Net::start(3).expect("three hosts");
    let dir = std::env::temp_dir().join(format!("cairn-netns-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let port = free_port();
    let _l1 = listen(&net, 1, port, &dir.join("l1.log"));
    let _l2 = listen(&net, 2, port, &dir.join("l2.log"));
    // The coordinators' side of the bridge: this process.
    let control = std::net::TcpListener::bind(("10.77.0.1", 0)).expect("a listener on the bridge");
    let to0 = control.local_addr().unwrap().to_string();
    let ips: Vec<String> = net
        .placement()
        .nodes
        .iter()
        .map(|(ip, _)| ip.clone())
        .collect();
    let (to1, to2) = (format!("{}:{port}", ips[1]), format!("{}:{port}", ips[2]));
    assert!(
        reaches(&net, 0, &to1) && reaches(&net, 0, &to2),
        "the listeners never came up"
    );
    assert!(reaches(&net, 0, &to0), "host 0 does not reach the bridge");

    // A partition between hosts 0 and 1 cuts 0 -> 1 and leaves 0 -> 2.
    let partition = net.partition(0, 1).expect("partition");
    assert!(
        !connects(&net, 0, &to1),
        "host 0 reached host 1 across the partition"
    );
    assert!(
        reaches(&net, 0, &to2),
        "the partition cut host 0 from host 2 too"
    );
    for f in &partition {
        f.heal().expect("heal the partition");
    }
    assert!(
        reaches(&net, 0, &to1),
        "host 0 does not reach host 1 after the heal"
    );

    // Host 0 cut off reaches no one; healed, everyone.
    let isolated = net.isolate(0).expect("isolate");
    assert!(!connects(&net, 0, &to1), "isolated host 0 reached host 1");
    assert!(
        !connects(&net, 0, &to0),
        "isolated host 0 reached the bridge"
    );
    isolated.heal().expect("heal the isolation");
    assert!(reaches(&net, 0, &to1) && reaches(&net, 0, &to0));

    // Host 0's control cut: the bridge's side is lost, the peers are not.
    let control_cut = net.cut_control(0).expect("cut control");
    assert!(
        !connects(&net, 0, &to0),
        "host 0 reached the coordinators' side through the cut"
    );
    assert!(
        reaches(&net, 0, &to1),
        "the control cut cut host 0 from its peer"
    );
    control_cut.heal().expect("heal the control cut");
    assert!(reaches(&net, 0, &to0));

    // Loss drops packets at random while in force; the rule is gone when healed.
    let loss = net.loss(0, 50).expect("loss");
    send(&net, 0, &to1);
    assert!(
        dropped(&net, "statistic") > 0,
        "half the packets lost, yet none dropped"
    );
    loss.heal().expect("heal the loss");
    assert!(!host0(&net, "iptables -w -S INPUT").contains("statistic"));

    // A slow link holds packets back (the token bucket's overlimits), and still connects.
    let slow = net.throttle(0, 128).expect("throttle");
    send(&net, 0, &to1);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let stats = host0(&net, "tc -s qdisc show dev eth0");
        let overlimits = stats
            .split_whitespace()
            .skip_while(|w| *w != "overlimits")
            .nth(1)
            .and_then(|n| n.parse::<u64>().ok());
        if overlimits.is_some_and(|n| n > 0) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "64 KiB at 128 kbit/s was never held back:\n{stats}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(reaches(&net, 0, &to2), "a slow link still connects");
    slow.heal().expect("heal the slow link");
    assert!(!host0(&net, "tc qdisc show dev eth0").contains("tbf"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn hosts_are_partitioned_isolated_slowed_and_healed() {
    if netns::in_own_namespace().expect("/proc/self/ns/net") {
        inside();
        return;
    }
    let status = Command::new("unshare")
        .args(["--net", "--"])
        .arg(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "netns::hosts_are_partitioned_isolated_slowed_and_healed",
            "--nocapture",
        ])
        .env(netns::INSIDE, netns::namespace().unwrap())
        .status()
        .expect("unshare (util-linux) on PATH");
    assert!(
        status.success(),
        "the run in a network namespace of its own failed (it needs root, iproute2, iptables \
         and python3; its output is above): {status}"
    );
}

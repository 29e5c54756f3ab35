//! Hosts of their own for a test's node processes: one network namespace per host, joined
//! by a bridge, and the network's faults between them — partitions, a host cut off from
//! everyone, packet loss, a slow link — through `iptables` and `tc` inside the hosts.
//!
//! The program that builds the network first runs itself again in a network namespace of
//! its own ([`reexec_in_own_namespace`]), so the bridge lives there and nothing of the
//! machine's own network is touched. Each host's namespace is held by a `sleep` process
//! started by `unshare --net` ([`Host`]), killed by its pid when the [`Net`] drops, pass or
//! fail, and by the kernel if the thread that started it dies first (`setpriv
//! --pdeathsig KILL`): the namespace goes with the last process in it. Processes join a host through
//! `nsenter --target <holder> --net`, which execs them (their pid is theirs).
//!
//! Needs root (`CAP_SYS_ADMIN` and `CAP_NET_ADMIN`), `unshare` and `nsenter` (util-linux),
//! `ip` and `tc` (iproute2) and `iptables`. Packet loss is an `iptables` `statistic` rule,
//! not `tc netem`: kernels built without `sch_netem` (this project's CI machine among them)
//! still have it.

use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::coordinated::Placement;
use crate::processes::ChildGuard;

/// The environment variable that marks a program re-run in its own namespace: it holds the
/// namespace it was re-run from (`/proc/self/ns/net`'s link, `net:[inode]`), so a program
/// still in that one (the variable inherited or set by hand) is not taken for re-run.
pub const INSIDE: &str = "CAIRN_NETNS_INSIDE";
/// The bridge's network: the bridge is `.1`, host `i` is `.(i + 2)`.
const SUBNET: &str = "10.77.0";
const BRIDGE: &str = "cairn0";

/// Runs this program again, with the same arguments, in a network namespace of its own
/// (`unshare --net`), unless it already runs in the one it made. Returns only in the new
/// namespace, or with an error saying what is missing (root, `unshare`).
pub fn reexec_in_own_namespace() -> anyhow::Result<()> {
    if in_own_namespace()? {
        return run(&["ip", "link", "set", "lo", "up"]);
    }
    let probe = Command::new("unshare")
        .args(["--net", "true"])
        .output()
        .map_err(|e| {
            anyhow::anyhow!("network namespaces need `unshare` (util-linux) on PATH: {e}")
        })?;
    if !probe.status.success() {
        anyhow::bail!(
            "network namespaces need root (unshare --net said: {})",
            String::from_utf8_lossy(&probe.stderr).trim()
        );
    }
    let exe = std::env::current_exe()?;
    let err = Command::new("unshare")
        .arg("--net")
        .arg("--")
        .arg(exe)
        .args(std::env::args_os().skip(1))
        .env(INSIDE, namespace()?)
        .exec();
    Err(anyhow::anyhow!(
        "cannot run again under unshare --net: {err}"
    ))
}

/// This process's network namespace (`net:[inode]`).
pub fn namespace() -> anyhow::Result<String> {
    Ok(std::fs::read_link("/proc/self/ns/net")
        .map_err(|e| anyhow::anyhow!("cannot read /proc/self/ns/net: {e}"))?
        .display()
        .to_string())
}

/// Whether this process was re-run in a namespace of its own: [`INSIDE`] names another
/// namespace than the one it is in.
pub fn in_own_namespace() -> anyhow::Result<bool> {
    let here = namespace()?;
    Ok(std::env::var(INSIDE).is_ok_and(|from| !from.is_empty() && from != here))
}

/// Runs `args` here; an error carrying its stderr if it fails.
fn run(args: &[&str]) -> anyhow::Result<()> {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .map_err(|e| anyhow::anyhow!("cannot run {}: {e}", args[0]))?;
    if !out.status.success() {
        anyhow::bail!(
            "`{}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// Runs `args` in the network namespace of process `pid`.
fn run_in(pid: u32, args: &[String]) -> anyhow::Result<()> {
    let pid = pid.to_string();
    let mut all: Vec<&str> = vec!["nsenter", "--target", &pid, "--net", "--"];
    all.extend(args.iter().map(String::as_str));
    run(&all)
}

fn words(line: &str) -> Vec<String> {
    line.split_whitespace().map(str::to_owned).collect()
}

/// One host: its address and the process that holds its namespace.
pub struct Host {
    /// Its address on the bridge.
    pub ip: String,
    holder: ChildGuard,
}

/// The hosts and their bridge.
pub struct Net {
    hosts: Vec<Host>,
}

/// A fault in force in one host, undone by [`NetFault::heal`].
#[derive(Debug, Clone)]
pub struct NetFault {
    pid: u32,
    undo: Vec<Vec<String>>,
}

impl NetFault {
    /// Applies `rules` in the namespace of `pid`, to be undone by `undo` in order.
    fn apply(pid: u32, rules: &[String], undo: Vec<String>) -> anyhow::Result<Self> {
        for rule in rules {
            run_in(pid, &words(rule))?;
        }
        Ok(Self {
            pid,
            undo: undo.iter().map(|u| words(u)).collect(),
        })
    }

    /// Undoes the fault (every rule, even after one fails); the first error.
    pub fn heal(&self) -> anyhow::Result<()> {
        let mut first = Ok(());
        for undo in &self.undo {
            if let Err(e) = run_in(self.pid, undo)
                && first.is_ok()
            {
                first = Err(e);
            }
        }
        first
    }
}

impl Net {
    /// Builds a bridge and `n` hosts on it, in a namespace [`reexec_in_own_namespace`]
    /// made (never in the one it was re-run from: the machine's own network is not
    /// touched).
    pub fn start(n: usize) -> anyhow::Result<Self> {
        anyhow::ensure!(n <= 200, "at most 200 hosts");
        anyhow::ensure!(
            in_own_namespace()?,
            "the hosts are built only in a network namespace of the run's own: call \
             netns::reexec_in_own_namespace first"
        );
        let bridge_ip = format!("{SUBNET}.1/24");
        run(&["ip", "link", "add", BRIDGE, "type", "bridge"])?;
        run(&["ip", "addr", "add", &bridge_ip, "dev", BRIDGE])?;
        run(&["ip", "link", "set", BRIDGE, "up"])?;
        let own = std::fs::read_link("/proc/self/ns/net")?;
        let mut hosts = Vec::with_capacity(n);
        for i in 0..n {
            // unshare and setpriv exec: the holder's pid is sleep's. It is killed with the
            // thread that starts it if its guard never drops (the run killed -9).
            let mut sleep = Command::new("unshare");
            sleep.args(["--net", "--", "setpriv", "--pdeathsig", "KILL", "--"]);
            sleep.args(["sleep", "infinity"]);
            let mut holder = ChildGuard::spawn("netns holder", sleep, Path::new("/dev/null"))?;
            let pid = holder.pid();
            // The namespace is made once the holder's namespace link differs from ours.
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                match std::fs::read_link(format!("/proc/{pid}/ns/net")) {
                    Ok(link) if link != own => break,
                    Ok(_) => {}
                    Err(e) => anyhow::bail!(
                        "host {i}'s namespace holder (unshare --net) is gone: {e} (running: {})",
                        holder.running()
                    ),
                }
                anyhow::ensure!(
                    Instant::now() < deadline && holder.running(),
                    "host {i}'s namespace was not made (unshare --net, setpriv)"
                );
                std::thread::sleep(Duration::from_millis(5));
            }
            let ip = format!("{SUBNET}.{}", i + 2);
            let veth = format!("cairn-h{i}");
            let p = pid.to_string();
            run(&[
                "ip", "link", "add", &veth, "type", "veth", "peer", "name", "eth0", "netns", &p,
            ])?;
            run(&["ip", "link", "set", &veth, "master", BRIDGE, "up"])?;
            for line in [
                "ip link set lo up".to_owned(),
                format!("ip addr add {ip}/24 dev eth0"),
                "ip link set eth0 up".to_owned(),
            ] {
                run_in(pid, &words(&line))?;
            }
            hosts.push(Host { ip, holder });
        }
        Ok(Self { hosts })
    }

    /// Where the cluster's processes go: coordinators on the bridge, node `i` on host `i`.
    pub fn placement(&self) -> Placement {
        Placement {
            coordinator_ip: format!("{SUBNET}.1"),
            nodes: self
                .hosts
                .iter()
                .map(|h| (h.ip.clone(), Some(h.holder.pid())))
                .collect(),
        }
    }

    /// A command that runs `program` on host `i` (its pid is the program's).
    pub fn command_in(&self, i: usize, program: &str) -> Command {
        self.placement().command_for(i, Path::new(program))
    }

    fn host(&self, i: usize) -> anyhow::Result<&Host> {
        self.hosts
            .get(i)
            .ok_or_else(|| anyhow::anyhow!("no host {i}"))
    }

    /// Hosts `a` and `b` lose every packet from each other (each drops what arrives from
    /// the other): the channels between them break while the rest stay up.
    pub fn partition(&self, a: usize, b: usize) -> anyhow::Result<Vec<NetFault>> {
        let (ha, hb) = (self.host(a)?, self.host(b)?);
        let first = self.drop_at(a, &format!("INPUT -i eth0 -s {} -j DROP", hb.ip))?;
        match self.drop_at(b, &format!("INPUT -i eth0 -s {} -j DROP", ha.ip)) {
            Ok(second) => Ok(vec![first, second]),
            Err(e) => {
                let _ = first.heal();
                Err(e)
            }
        }
    }

    /// Host `a` drops every packet that reaches it from the bridge: cut off from every
    /// peer and the coordinators (its own loopback, to its bank, stays up).
    pub fn isolate(&self, a: usize) -> anyhow::Result<NetFault> {
        self.drop_at(a, "INPUT -i eth0 -j DROP")
    }

    /// Host `a` drops every packet from the coordinators' side of the bridge: its control
    /// stream breaks while its channels to the other hosts stay up.
    pub fn cut_control(&self, a: usize) -> anyhow::Result<NetFault> {
        self.drop_at(a, &format!("INPUT -i eth0 -s {SUBNET}.1 -j DROP"))
    }

    /// Host `a` drops `percent` of the packets that reach it from the bridge, at random.
    pub fn loss(&self, a: usize, percent: u32) -> anyhow::Result<NetFault> {
        anyhow::ensure!((1..=99).contains(&percent), "loss must be 1 to 99 %");
        self.drop_at(
            a,
            &format!(
                "INPUT -i eth0 -m statistic --mode random --probability 0.{percent:02} -j DROP"
            ),
        )
    }

    /// An iptables `rule` in host `a`, taken away by the fault's heal.
    fn drop_at(&self, a: usize, rule: &str) -> anyhow::Result<NetFault> {
        NetFault::apply(
            self.host(a)?.holder.pid(),
            &[format!("iptables -w -A {rule}")],
            vec![format!("iptables -w -D {rule}")],
        )
    }

    /// Host `a` sends at most `kbit` kilobits a second (a token bucket on its link).
    pub fn throttle(&self, a: usize, kbit: u32) -> anyhow::Result<NetFault> {
        anyhow::ensure!(kbit >= 8, "a link of at least 8 kbit/s");
        NetFault::apply(
            self.host(a)?.holder.pid(),
            &[format!(
                "tc qdisc add dev eth0 root tbf rate {kbit}kbit burst 16kb latency 2s"
            )],
            vec!["tc qdisc del dev eth0 root".to_owned()],
        )
    }
}

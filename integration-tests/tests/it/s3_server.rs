//! The S3 server the tests start (SeaweedFS, `cairn_integration_tests::s3`): two at once
//! on their own ports, signed requests only, conditional puts, a stop and a restart on the
//! same data, and no process left once dropped.

use std::time::Instant;

use cairn_integration_tests::s3::S3Server;
use object_store::path::Path;
use object_store::{ObjectStore as _, ObjectStoreExt as _, PutMode, PutOptions, PutPayload};

/// The local TCP ports process `pid` listens on (its sockets in /proc/net/tcp{,6}).
fn listening_ports(pid: u32) -> Vec<u16> {
    let inodes: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|dir| {
            dir.filter_map(|entry| std::fs::read_link(entry.ok()?.path()).ok())
                .filter_map(|link| {
                    let link = link.to_string_lossy().into_owned();
                    Some(link.strip_prefix("socket:[")?.strip_suffix(']')?.to_owned())
                })
                .collect()
        })
        .unwrap_or_default();
    let mut ports = Vec::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let text = std::fs::read_to_string(table).unwrap_or_default();
        for line in text.lines().skip(1) {
            let fields: Vec<&str> = line.split_whitespace().collect();
            // local_address, ..., st (0A: LISTEN), ..., inode (the tenth field).
            if fields.len() > 9 && fields[3] == "0A" && inodes.iter().any(|i| i == fields[9]) {
                let port = fields[1].rsplit(':').next().unwrap_or("0");
                ports.push(u16::from_str_radix(port, 16).expect("a hex port"));
            }
        }
    }
    ports.sort_unstable();
    ports.dedup();
    ports
}

fn process_exists(pid: u32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_seaweedfs_servers_run_at_once_restart_and_leave_nothing_behind() {
    let started = Instant::now();
    let (a, b) = tokio::join!(S3Server::start(), S3Server::start());
    let (mut a, b) = (a.expect("server a starts"), b.expect("server b starts"));
    println!("two servers ready in {:?}", started.elapsed());
    assert_ne!(a.endpoint, b.endpoint);
    assert_eq!(a.url("snapshots/"), "s3://cairn/snapshots/");
    let env = a.env();
    assert!(env.contains(&("AWS_REGION".to_owned(), "us-east-1".to_owned())));
    assert!(
        env.iter()
            .any(|(k, v)| k == "AWS_SECRET_ACCESS_KEY" && *v == a.secret_key)
    );

    // Each listens on its own eight ports and nothing else (no fixed 8333, 9333, ...), and
    // the pid it is killed by is `weed` itself.
    for server in [&a, &b] {
        let pid = server.pid().expect("running");
        let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).expect("its /proc");
        assert_eq!(comm.trim(), "weed", "pid {pid} is weed");
        let mut expected = server.ports();
        expected.sort_unstable();
        assert_eq!(
            listening_ports(pid),
            expected,
            "weed {pid} listens on its ports only"
        );
    }

    // Both answer, each with its own bucket and its own data (the readiness object gone).
    a.put("x/one", b"from a").await.expect("put on a");
    b.put("x/one", b"from b").await.expect("put on b");
    assert_eq!(
        a.get("x/one").await.unwrap().as_deref(),
        Some(&b"from a"[..])
    );
    assert_eq!(
        b.get("x/one").await.unwrap().as_deref(),
        Some(&b"from b"[..])
    );
    assert_eq!(a.get("x/none").await.unwrap(), None);
    assert_eq!(a.list("").await.unwrap(), vec!["x/one".to_owned()]);

    // Signatures are checked: a wrong secret and an unknown key are refused.
    let one = Path::from("x/one");
    let wrong = a.store_with(&a.access_key, "not-the-secret").unwrap();
    let refused = format!(
        "{:#}",
        anyhow::Error::new(wrong.get(&one).await.unwrap_err())
    );
    assert!(
        refused.contains("SignatureDoesNotMatch") && refused.contains("403"),
        "a wrong secret: {refused}"
    );
    let unknown = a.store_with("nobody", &a.secret_key).unwrap();
    let refused = format!(
        "{:#}",
        anyhow::Error::new(unknown.get(&one).await.unwrap_err())
    );
    assert!(
        refused.contains("InvalidAccessKeyId") && refused.contains("403"),
        "an unknown access key: {refused}"
    );

    // A create-only put (If-None-Match: *) creates a new key and refuses an existing one
    // (412, which object_store reports as AlreadyExists). (The store is for a's port and
    // bucket: it still works after a's restart.)
    let store = a.store_with(&a.access_key, &a.secret_key).unwrap();
    let create = |key: &'static str| {
        let store = store.clone();
        async move {
            let options = PutOptions {
                mode: PutMode::Create,
                ..PutOptions::default()
            };
            store
                .put_opts(
                    &Path::from(key),
                    PutPayload::from_static(b"created"),
                    options,
                )
                .await
        }
    };
    let refused_412 = |result: &object_store::Result<object_store::PutResult>| match result {
        Err(object_store::Error::AlreadyExists { source, .. }) => {
            matches!(
                source.downcast_ref::<object_store::Error>(),
                Some(object_store::Error::Precondition { .. })
            )
        }
        _ => false,
    };
    create("x/two").await.expect("a new key is created");
    let again = create("x/two").await;
    assert!(refused_412(&again), "an existing key: {again:?}");
    assert_eq!(
        a.get("x/two").await.unwrap().as_deref(),
        Some(&b"created"[..])
    );

    // Stopped: requests fail; the other server is untouched. Started again: same port,
    // same data.
    let first_pid = a.pid().expect("running");
    a.stop();
    assert!(a.pid().is_none());
    assert!(
        !process_exists(first_pid),
        "weed {first_pid} is gone once stopped"
    );
    assert!(
        a.get("x/one").await.is_err(),
        "a stopped server does not answer"
    );
    assert_eq!(
        b.get("x/one").await.unwrap().as_deref(),
        Some(&b"from b"[..])
    );
    let restarted = Instant::now();
    a.start_again().await.expect("server a starts again");
    println!("restarted in {:?}", restarted.elapsed());
    assert_eq!(
        a.get("x/one").await.unwrap().as_deref(),
        Some(&b"from a"[..])
    );
    let again = create("x/two").await;
    assert!(
        refused_412(&again),
        "still there after the restart: {again:?}"
    );
    a.delete("x/one").await.expect("delete");
    assert_eq!(a.list("x/").await.unwrap(), vec!["x/two".to_owned()]);

    // Dropped: the processes are gone, the directories removed.
    let pids = [a.pid().expect("running"), b.pid().expect("running")];
    let dirs = [a.dir().to_owned(), b.dir().to_owned()];
    drop(a);
    drop(b);
    for pid in pids {
        assert!(!process_exists(pid), "weed {pid} is gone once dropped");
    }
    for dir in dirs {
        assert!(!dir.exists(), "{} is removed", dir.display());
    }
}

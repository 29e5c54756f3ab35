//! The console in an ordinary browser under the secure default (mutual TLS and bearer
//! tokens), with nothing in front: headless Chromium trusts the cluster's CA as a user does
//! (imported once into its NSS database), opens the console without a client certificate,
//! is shown the login page, is refused a wrong token, logs in with a viewer's token (a
//! session cookie it cannot read from script), reads the pages and the API, logs out; a
//! browser that does not trust the CA does not load it, and a login posted from another
//! site is refused.

use std::process::Command;
use std::time::Duration;

use cairn_integration_tests::browser::Browser;
use cairn_integration_tests::coordinated::{certs_init, tls_args};
use cairn_integration_tests::processes::{ChildGuard, binary, eventually, free_port};
use cairn_rpc::server::auth::{Role, new_token};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_opens_in_a_browser_under_mutual_tls_with_a_token_login() {
    let dir = std::env::temp_dir().join(format!(
        "cairn-console-login-{}-{}",
        std::process::id(),
        free_port()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let certs = dir.join("certs");
    certs_init(&certs, 1, &[]).unwrap();
    let (viewer, line) = new_token(Role::Viewer, Some("vera"));
    let tokens = dir.join("tokens");
    std::fs::write(&tokens, format!("{line}\n")).unwrap();
    let port = free_port();
    let mut command = Command::new(binary("cairn-coordinator").unwrap());
    command
        .args(["--listen", &format!("127.0.0.1:{}", free_port())])
        .args(["--metrics-listen", &format!("127.0.0.1:{port}")])
        .arg("--data-dir")
        .arg(dir.join("data"))
        .arg("--auth-tokens")
        .arg(&tokens)
        .args(tls_args(&certs, "coordinator"));
    let _coordinator =
        ChildGuard::spawn("cairn-coordinator", command, &dir.join("coordinator.log")).unwrap();
    eventually("the console listens", Duration::from_secs(30), || async {
        Ok(tokio::net::TcpStream::connect(("127.0.0.1", port)).await?)
    })
    .await
    .unwrap();
    // The certificate names what a user dials from this host: 127.0.0.1 and localhost.
    for host in ["127.0.0.1", "localhost"] {
        let base = format!("https://{host}:{port}");
        let mut browser = Browser::launch(Some(&certs.join("ca.pem"))).await.unwrap();

        // Not logged in: the login page, saying why (401).
        browser.open(&format!("{base}/snapshots")).await.unwrap();
        let (path, text) = browser.page_text().await.unwrap();
        assert_eq!(path, "/snapshots");
        assert!(text.contains("a bearer token is required"), "{text}");
        assert!(browser.html().await.unwrap().contains("id=\"login\""));

        // A wrong token: the login page again, with a message.
        let submit = |token: &str| {
            format!(
                "document.getElementById('token').value = {token:?}; \
                 document.getElementById('login').submit()"
            )
        };
        browser.eval_and_load(&submit("not-a-token")).await.unwrap();
        let (path, text) = browser.page_text().await.unwrap();
        assert_eq!(path, "/login");
        assert!(text.contains("unknown token"), "{text}");

        // The viewer's token: a session, and the snapshots.
        browser.eval_and_load(&submit(&viewer)).await.unwrap();
        let (path, text) = browser.page_text().await.unwrap();
        assert_eq!(path, "/snapshots", "{text}");
        assert!(!text.contains("bearer token"), "{text}");
        // HttpOnly: no script of the page can read the session.
        assert_eq!(browser.eval("document.cookie").await.unwrap(), "");
        for page in ["/policy", "/restores", "/nodes"] {
            browser.open(&format!("{base}{page}")).await.unwrap();
            let (path, text) = browser.page_text().await.unwrap();
            assert_eq!(path, page);
            assert!(!text.contains("401"), "{page}: {text}");
        }
        browser
            .open(&format!("{base}/api/v1/leadership"))
            .await
            .unwrap();
        let (_, json) = browser.page_text().await.unwrap();
        let leadership: serde_json::Value = serde_json::from_str(&json).unwrap();
        assert!(leadership.get("answeredBy").is_some(), "{leadership}");

        // The header's "Log out" ends it: the login page, then no session.
        browser.open(&format!("{base}/nodes")).await.unwrap();
        browser
            .eval_and_load("document.querySelector('header form.logout').submit()")
            .await
            .unwrap();
        let (path, _) = browser.page_text().await.unwrap();
        assert_eq!(path, "/login");
        browser.open(&format!("{base}/snapshots")).await.unwrap();
        let (_, text) = browser.page_text().await.unwrap();
        assert!(text.contains("a bearer token is required"), "{text}");

        // A login posted from another site is refused (CSRF).
        let form = format!(
            "data:text/html,<form id=f method=post action={base}/login>\
             <input name=token value={viewer}></form>"
        );
        browser.open(&form).await.unwrap();
        browser
            .eval_and_load("document.getElementById('f').submit()")
            .await
            .unwrap();
        let (_, text) = browser.page_text().await.unwrap();
        assert!(
            text.contains("must come from this console's own page"),
            "{text}"
        );
    }

    // A browser that was never told to trust the cluster's CA refuses the console.
    let mut stranger = Browser::launch(None).await.unwrap();
    let e = stranger
        .open(&format!("https://127.0.0.1:{port}/login"))
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("ERR_CERT_AUTHORITY_INVALID"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

//! The command lines as an operator's shell and tools meet them: `--version` names
//! the program and its git revision, `cairnctl completion` writes a script for each shell,
//! a reader that closes the pipe (`cairnctl … | head -1`) ends cairnctl quietly, and
//! `--log-format json` writes one flat object per line.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

use cairn_integration_tests::processes::{binary, free_port};

/// One of cairn's programs, without the test's own `CAIRN_*` variables.
fn program(name: &str) -> Command {
    let mut command = Command::new(binary(name).unwrap());
    for (key, _) in std::env::vars_os() {
        if key.to_string_lossy().starts_with("CAIRN_") {
            command.env_remove(&key);
        }
    }
    command
}

fn cairnctl() -> Command {
    program("cairnctl")
}

#[test]
fn every_program_names_itself_and_the_git_revision_it_was_built_from() {
    let head = git(&["rev-parse", "--short=12", "HEAD"]);
    for name in ["cairnctl", "cairn-node", "cairn-coordinator", "cairn-bank"] {
        let out = program(name).arg("--version").output().unwrap();
        assert!(out.status.success(), "{name}: {out:?}");
        assert_eq!(
            String::from_utf8(out.stdout).unwrap().trim(),
            format!("{name} {} (git {head})", env!("CARGO_PKG_VERSION"))
        );
    }
}

fn git(args: &[&str]) -> String {
    let out = Command::new("git")
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("git (the tests run in a checkout): install git");
    assert!(out.status.success(), "git {args:?}: {out:?}");
    String::from_utf8(out.stdout).unwrap().trim().to_owned()
}

#[test]
fn completion_scripts_for_each_shell_name_the_commands_and_flags() {
    // Each shell's words for a command's long flags: fish's `-l coordinator`.
    for (shell, marker, flag) in [
        ("bash", "complete -F", "--"),
        ("zsh", "#compdef cairnctl", "--"),
        ("fish", "complete -c cairnctl", "-l "),
    ] {
        let out = cairnctl().args(["completion", shell]).output().unwrap();
        assert!(out.status.success(), "{shell}: {out:?}");
        let script = String::from_utf8(out.stdout).unwrap();
        let coordinator = format!("{flag}coordinator");
        let if_epoch = format!("{flag}if-epoch");
        for word in [marker, "snapshot", "restore", &coordinator, &if_epoch] {
            assert!(script.contains(word), "{shell}'s script lacks {word:?}");
        }
    }
    let out = cairnctl().args(["completion", "tcsh"]).output().unwrap();
    assert_eq!(out.status.code(), Some(64), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("bash"));
}

/// As `cairnctl … | head -0`: the pipe's reader is gone before the first line.
#[test]
fn a_closed_stdout_ends_cairnctl_quietly_with_zero() {
    for args in [
        &["completion", "bash"][..],
        &["-o", "json", "auth", "token", "--role", "viewer"][..],
    ] {
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader);
        let out = cairnctl()
            .args(args)
            .stdout(writer)
            .stderr(Stdio::piped())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success() && stderr.is_empty(),
            "cairnctl {args:?} into a closed pipe: {} {stderr}",
            out.status
        );
    }
}

/// Killed when the test ends, pass or fail.
struct Killed(std::process::Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn json_logs_put_timestamp_level_and_message_at_the_top_with_plain_values() {
    let dir = std::env::temp_dir().join(format!(
        "cairn-jsonlog-{}-{}",
        std::process::id(),
        free_port()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let listen = format!("127.0.0.1:{}", free_port());
    let child = program("cairn-coordinator")
        .args(["--listen", &listen, "--log-format", "json", "--log", "info"])
        .arg("--data-dir")
        .arg(&dir)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut child = Killed(child);
    let stderr = child.0.stderr.take().unwrap();
    // Lines until the one saying it serves (the reader ends when the process does).
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines() {
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    let mut seen = Vec::new();
    loop {
        let line = rx
            .recv_timeout(Duration::from_secs(20))
            .unwrap_or_else(|_| panic!("no \"coordinator serving\" line; saw {seen:#?}"))
            .unwrap();
        let event: serde_json::Value = serde_json::from_str(&line)
            .unwrap_or_else(|e| panic!("not one JSON object a line ({e}): {line}"));
        let object = event.as_object().unwrap();
        for key in ["timestamp", "level", "target", "message"] {
            assert!(object.contains_key(key), "no top-level {key:?}: {line}");
        }
        for nested in ["fields", "spans"] {
            assert!(!object.contains_key(nested), "{nested:?} nested: {line}");
        }
        for (key, value) in object {
            if let Some(text) = value.as_str() {
                assert!(
                    !text.starts_with("Some("),
                    "{key} is Debug of an Option: {line}"
                );
            }
        }
        seen.push(line);
        if event["message"] == "coordinator serving" {
            assert_eq!(event["addr"], listen.as_str(), "{event}");
            break;
        }
    }
    drop(child);
    let _ = std::fs::remove_dir_all(&dir);
}

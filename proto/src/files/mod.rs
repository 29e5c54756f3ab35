//! The text files cairn's daemons read: a topology (`--topology`) and a tokens file
//! (`--auth-tokens`). Their parsers take text from outside and are fuzzed
//! ([`crate::fuzzing`]); each error names the line.

use cairn_core::{ChannelId, NodeId, Topology};

pub mod tokens;

/// Parses a topology file: one directed channel `FROM>TO` per line, or a lone node id for a
/// node without channels; blank lines and `#` comments are skipped. The nodes are every id
/// named. Errors name the line.
pub fn parse_topology(text: &str) -> Result<Topology, String> {
    let mut nodes = Vec::new();
    let mut channels = Vec::new();
    for (number, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let bad = |why: &str| format!("line {}: `{line}`: {why}", number + 1);
        match line.split_once('>') {
            Some((from, to)) => {
                let (from, to) = (from.trim(), to.trim());
                if from.is_empty() || to.is_empty() || to.contains('>') {
                    return Err(bad("expected FROM>TO"));
                }
                if from.contains(char::is_whitespace) || to.contains(char::is_whitespace) {
                    return Err(bad("node ids cannot hold spaces"));
                }
                nodes.extend([NodeId::new(from), NodeId::new(to)]);
                channels.push(ChannelId::new(from, to));
            }
            None if line.contains(char::is_whitespace) => {
                return Err(bad("expected FROM>TO or a single node id"));
            }
            None => nodes.push(NodeId::new(line)),
        }
    }
    if nodes.is_empty() {
        return Err("no nodes: the file names no channel and no node".into());
    }
    Topology::from_channels(nodes, channels).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ring_with_comments_and_a_lone_node() {
        let t = parse_topology("# ring\nn1>n2\n n2 > n3 \nn3>n1 # back\n\nn4\n").unwrap();
        assert_eq!(t.nodes().len(), 4);
        assert_eq!(t.channels().len(), 3);
        assert!(t.channels().contains(&ChannelId::new("n2", "n3")));
    }

    #[test]
    fn bad_lines_are_named() {
        assert_eq!(
            parse_topology("n1>n2\nn1>\n").unwrap_err(),
            "line 2: `n1>`: expected FROM>TO"
        );
        assert!(parse_topology("n1>n1").unwrap_err().contains("n1"));
        assert!(parse_topology("a b").unwrap_err().starts_with("line 1"));
        assert!(parse_topology("# nothing\n").is_err());
    }
}

//! Per-principal tokens: a principal listed here can only be claimed with its own token.
//!
//! Without this file a principal is a name any holder of the cluster token may give, so
//! "private" regions are private from careless clients, not from hostile ones. With it,
//! a HELLO naming a listed principal (or naming none, for `anonymous`) must carry that
//! principal's token instead of the cluster token; names not listed keep the cluster
//! token's rule, so existing clients keep working while the principals that matter are
//! locked down.
//!
//! The file is text, one `NAME TOKEN` per line; blank lines and lines starting with `#`
//! are skipped. It is parsed here without I/O so its rules are tested on their own.

use camelot_proto::limits::{PRINCIPAL_BYTES_MAX, TOKEN_BYTES_MAX};
use std::collections::BTreeMap;

/// Most principals a tokens file may list: a server checks one map lookup per HELLO,
/// and a file this long is a mistake, not a deployment.
pub const PRINCIPAL_TOKENS_MAX: usize = 4096;
/// Largest tokens file read, so a wrong path (a device, a log) fails fast.
pub const PRINCIPAL_TOKENS_FILE_BYTES_MAX: usize = 1 << 20;

/// Principal name → the token that must accompany it.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct PrincipalTokens(BTreeMap<String, Vec<u8>>);

impl std::fmt::Debug for PrincipalTokens {
    // Tokens are secrets: a debug print of a config must not leak them.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_set().entries(self.0.keys()).finish()
    }
}

/// Why a tokens file was refused; `line` counts from 1.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PrincipalTokensError {
    #[error("line {line}: expected `NAME TOKEN` (two words)")]
    Syntax { line: usize },
    #[error("line {line}: a principal is 1 to {PRINCIPAL_BYTES_MAX} bytes")]
    NameLength { line: usize },
    #[error("line {line}: a token is 1 to {TOKEN_BYTES_MAX} bytes")]
    TokenLength { line: usize },
    #[error("line {line}: principal {name:?} is listed twice")]
    Duplicate { line: usize, name: String },
    #[error("more than {PRINCIPAL_TOKENS_MAX} principals")]
    TooMany,
    #[error("the file is over {PRINCIPAL_TOKENS_FILE_BYTES_MAX} bytes")]
    TooLarge,
}

impl PrincipalTokens {
    /// Parses a tokens file's text.
    pub fn parse(text: &str) -> Result<Self, PrincipalTokensError> {
        if text.len() > PRINCIPAL_TOKENS_FILE_BYTES_MAX {
            return Err(PrincipalTokensError::TooLarge);
        }
        let mut map = BTreeMap::new();
        for (i, raw) in text.lines().enumerate() {
            let line = i + 1;
            let l = raw.trim();
            if l.is_empty() || l.starts_with('#') {
                continue;
            }
            let mut words = l.split_whitespace();
            let (Some(name), Some(token), None) = (words.next(), words.next(), words.next()) else {
                return Err(PrincipalTokensError::Syntax { line });
            };
            if name.len() > PRINCIPAL_BYTES_MAX {
                return Err(PrincipalTokensError::NameLength { line });
            }
            if token.len() > TOKEN_BYTES_MAX {
                return Err(PrincipalTokensError::TokenLength { line });
            }
            if map.len() == PRINCIPAL_TOKENS_MAX {
                return Err(PrincipalTokensError::TooMany);
            }
            if map
                .insert(name.to_owned(), token.as_bytes().to_vec())
                .is_some()
            {
                return Err(PrincipalTokensError::Duplicate {
                    line,
                    name: name.to_owned(),
                });
            }
        }
        Ok(PrincipalTokens(map))
    }

    /// The token `principal` must present, if it is listed.
    pub fn token_of(&self, principal: &str) -> Option<&[u8]> {
        self.0.get(principal).map(Vec::as_slice)
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn parses_names_and_tokens_skipping_comments() {
        let t = PrincipalTokens::parse("# who\n\nalice  s3cret\n  bob\tb0b \n").unwrap();
        assert_eq!(t.len(), 2);
        assert_eq!(t.token_of("alice"), Some(&b"s3cret"[..]));
        assert_eq!(t.token_of("bob"), Some(&b"b0b"[..]));
        assert_eq!(t.token_of("carol"), None);
        assert!(
            !format!("{t:?}").contains("s3cret"),
            "tokens stay out of logs"
        );
    }

    #[test]
    fn refuses_what_it_cannot_read_exactly() {
        use PrincipalTokensError as E;
        assert_eq!(
            PrincipalTokens::parse("alice\n"),
            Err(E::Syntax { line: 1 })
        );
        assert_eq!(
            PrincipalTokens::parse("\nalice a b\n"),
            Err(E::Syntax { line: 2 })
        );
        assert_eq!(
            PrincipalTokens::parse("a x\na y\n"),
            Err(E::Duplicate {
                line: 2,
                name: "a".into()
            })
        );
        let long_name = format!("{} t\n", "n".repeat(PRINCIPAL_BYTES_MAX + 1));
        assert_eq!(
            PrincipalTokens::parse(&long_name),
            Err(E::NameLength { line: 1 })
        );
        let long_token = format!("n {}\n", "t".repeat(TOKEN_BYTES_MAX + 1));
        assert_eq!(
            PrincipalTokens::parse(&long_token),
            Err(E::TokenLength { line: 1 })
        );
        let many: String = (0..=PRINCIPAL_TOKENS_MAX)
            .map(|i| format!("p{i} t\n"))
            .collect();
        assert_eq!(PrincipalTokens::parse(&many), Err(E::TooMany));
    }

    proptest! {
        #[test]
        fn any_text_parses_or_is_refused_without_panicking(text in ".{0,400}") {
            if let Ok(t) = PrincipalTokens::parse(&text) {
                prop_assert!(t.len() <= PRINCIPAL_TOKENS_MAX);
            }
        }

        #[test]
        fn what_is_written_is_read_back(
            entries in proptest::collection::btree_map("[a-z]{1,64}", "[!-~]{1,255}", 0..20)
        ) {
            let text: String = entries.iter().map(|(n, t)| format!("{n} {t}\n")).collect();
            let t = PrincipalTokens::parse(&text).unwrap();
            prop_assert_eq!(t.len(), entries.len());
            for (n, tok) in &entries {
                prop_assert_eq!(t.token_of(n), Some(tok.as_bytes()));
            }
        }
    }
}

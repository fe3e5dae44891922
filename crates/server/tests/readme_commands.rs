//! The README's list of Redis commands is the command table's: this fails when they
//! differ. `CAMELOT_BLESS=1 cargo test -p camelot-server --test readme_commands`
//! rewrites the README section from the table.

use camelot_server::resp::commands::{commands_markdown, README_BEGIN, README_END};

#[test]
fn the_readme_lists_exactly_the_command_table() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../README.md");
    let readme = std::fs::read_to_string(path).expect("README.md reads");
    let begin = readme
        .find(README_BEGIN)
        .expect("the README has the begin marker")
        + README_BEGIN.len();
    let end = readme
        .find(README_END)
        .expect("the README has the end marker");
    assert!(begin <= end, "the markers are out of order");
    let want = format!("\n{}", commands_markdown());
    if std::env::var_os("CAMELOT_BLESS").is_some() {
        let updated = format!("{}{want}{}", &readme[..begin], &readme[end..]);
        std::fs::write(path, updated).expect("README.md writes");
        return;
    }
    assert_eq!(
        &readme[begin..end],
        want,
        "the README's command list is stale; regenerate it with \
         CAMELOT_BLESS=1 cargo test -p camelot-server --test readme_commands"
    );
}

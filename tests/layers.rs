//! The crate's layering, checked on its source: the core names no transport and not the C
//! layer, and no two modules depend on each other (at the top level, and among the children of
//! a transport), so that a transport, or a test double, is added without editing the core.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

/// The core: what every transport builds on.
const CORE: &[&str] = &["conn", "cq", "mr", "domain", "ctx"];
/// What the core must not name.
const ABOVE_OR_BESIDE_CORE: &[&str] = &["verbs", "shm", "ffi"];

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// The modules directly under `dir`: `x.rs` and `x/`.
fn modules(dir: &Path) -> BTreeSet<String> {
    let mut m = BTreeSet::new();
    for e in fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_stem().unwrap().to_string_lossy().into_owned();
        if p.is_dir()
            || (p.extension().is_some_and(|x| x == "rs") && name != "lib" && name != "mod")
        {
            m.insert(name);
        }
    }
    m
}

/// Every `.rs` file of module `m` under `dir`, with comments dropped.
fn sources(dir: &Path, m: &str) -> Vec<String> {
    let mut out = Vec::new();
    let file = dir.join(format!("{m}.rs"));
    if file.exists() {
        out.push(fs::read_to_string(file).unwrap());
    }
    let mut stack = vec![dir.join(m)];
    while let Some(d) = stack.pop() {
        let Ok(rd) = fs::read_dir(&d) else { continue };
        for e in rd {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(fs::read_to_string(p).unwrap());
            }
        }
    }
    out.iter()
        .map(|s| {
            s.lines()
                .map(|l| l.split("//").next().unwrap())
                .collect::<Vec<_>>()
                .join("\n")
        })
        .collect()
}

/// The names that follow `prefix` in `src`: `prefix::a`, and each of `prefix::{a, b::c}`.
fn named_after(src: &str, prefix: &str) -> BTreeSet<String> {
    let ident = |s: &str| -> String {
        s.chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect()
    };
    let mut names = BTreeSet::new();
    for (i, _) in src.match_indices(prefix) {
        let rest = &src[i + prefix.len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let group = &group[..group.find('}').unwrap_or(group.len())];
            for part in group.split(',') {
                names.insert(ident(part.trim()));
            }
        } else {
            names.insert(ident(rest));
        }
    }
    names
}

/// Which of `dir`'s modules each one names (through `prefixes`).
fn dependencies(dir: &Path, prefixes: &[&str]) -> BTreeMap<String, BTreeSet<String>> {
    let mods = modules(dir);
    mods.iter()
        .map(|m| {
            let mut deps = BTreeSet::new();
            for s in sources(dir, m) {
                for p in prefixes {
                    deps.extend(named_after(&s, p).into_iter().filter(|d| mods.contains(d)));
                }
            }
            deps.remove(m);
            (m.clone(), deps)
        })
        .collect()
}

/// The groups of modules that reach each other (strongly connected, more than one).
fn cycles(deps: &BTreeMap<String, BTreeSet<String>>) -> Vec<BTreeSet<String>> {
    let reach = |from: &String| {
        let mut seen = BTreeSet::new();
        let mut todo = vec![from.clone()];
        while let Some(m) = todo.pop() {
            for d in &deps[&m] {
                if seen.insert(d.clone()) {
                    todo.push(d.clone());
                }
            }
        }
        seen
    };
    let reaches: BTreeMap<_, _> = deps.keys().map(|m| (m.clone(), reach(m))).collect();
    let mut groups: Vec<BTreeSet<String>> = Vec::new();
    for m in deps.keys() {
        let group: BTreeSet<String> = deps
            .keys()
            .filter(|o| *o == m || (reaches[m].contains(*o) && reaches[*o].contains(m)))
            .cloned()
            .collect();
        if group.len() > 1 && !groups.contains(&group) {
            groups.push(group);
        }
    }
    groups
}

#[test]
fn the_core_names_no_transport_and_not_the_c_layer() {
    let deps = dependencies(&src(), &["crate::"]);
    for m in CORE {
        let bad: Vec<_> = deps[*m]
            .iter()
            .filter(|d| ABOVE_OR_BESIDE_CORE.contains(&d.as_str()))
            .collect();
        assert!(bad.is_empty(), "src/{m} names {bad:?}");
    }
}

#[test]
fn no_two_top_level_modules_depend_on_each_other() {
    let deps = dependencies(&src(), &["crate::"]);
    assert!(
        deps.contains_key("conn") && deps["ctx"].contains("conn"),
        "{deps:?}"
    );
    assert_eq!(cycles(&deps), Vec::<BTreeSet<String>>::new());
}

#[test]
fn no_two_parts_of_a_transport_depend_on_each_other() {
    for t in ["shm", "verbs"] {
        let prefix = format!("crate::{t}::");
        let deps = dependencies(&src().join(t), &[&prefix, "super::"]);
        assert!(deps.len() > 3, "{t}: {deps:?}");
        assert_eq!(cycles(&deps), Vec::<BTreeSet<String>>::new(), "in src/{t}");
    }
}

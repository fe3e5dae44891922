//! The static source: a map in a file, TOML when the name ends in `.toml`, JSON otherwise.
//! What `camelot dev` and a cluster without etcd run from.

use std::io::Read;
use std::path::Path;

use crate::error::{MapError, SourceError};
use crate::map::{ClusterMap, MAP_BYTES_MAX};

fn is_toml(path: &Path) -> bool {
    path.extension().is_some_and(|e| e == "toml")
}

/// Reads and validates a map file, reading at most [`MAP_BYTES_MAX`] + 1 bytes of it.
pub fn load(path: &Path) -> Result<ClusterMap, SourceError> {
    let name = path.display().to_string();
    let io = |source| SourceError::Io {
        path: name.clone(),
        source,
    };
    let file = std::fs::File::open(path).map_err(io)?;
    let mut bytes = Vec::new();
    file.take(MAP_BYTES_MAX as u64 + 1)
        .read_to_end(&mut bytes)
        .map_err(io)?;
    let parsed = if is_toml(path) {
        match std::str::from_utf8(&bytes) {
            Ok(text) => ClusterMap::from_toml(text),
            Err(e) => Err(MapError::Parse(e.to_string())),
        }
    } else {
        ClusterMap::from_json(&bytes)
    };
    parsed.map_err(|source| SourceError::Map { path: name, source })
}

/// Writes a valid map, through a temporary file renamed into place so a reader never
/// sees half a map.
pub fn save(path: &Path, map: &ClusterMap) -> Result<(), SourceError> {
    let name = path.display().to_string();
    map.validate().map_err(|source| SourceError::Map {
        path: name.clone(),
        source,
    })?;
    let text = if is_toml(path) {
        map.to_toml().map_err(|source| SourceError::Map {
            path: name.clone(),
            source,
        })?
    } else {
        map.to_json()
    };
    let tmp = path.with_extension("tmp");
    let io = |source| SourceError::Io {
        path: name.clone(),
        source,
    };
    std::fs::write(&tmp, text).map_err(io)?;
    std::fs::rename(&tmp, path).map_err(io)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::map::Node;

    #[test]
    fn files_round_trip_and_bad_ones_are_refused() {
        let dir = std::env::temp_dir().join(format!("camelot-cluster-src-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let nodes = (0..3)
            .map(|i| Node {
                id: i,
                addr: ([127, 0, 0, 1], 7100 + i as u16).into(),
                weight: 1 + i,
                lease: 0,
                incarnation: 0,
            })
            .collect();
        let map = ClusterMap::initial(nodes, 128, 2).unwrap();
        for name in ["map.json", "map.toml"] {
            let path = dir.join(name);
            save(&path, &map).unwrap();
            assert_eq!(load(&path).unwrap(), map);
        }
        let bad = dir.join("bad.json");
        std::fs::write(
            &bad,
            br#"{"epoch":1,"replication":1,"nodes":[],"assignment":[]}"#,
        )
        .unwrap();
        assert!(matches!(
            load(&bad),
            Err(SourceError::Map {
                source: MapError::Partitions { .. },
                ..
            })
        ));
        assert!(matches!(
            load(&dir.join("absent.json")),
            Err(SourceError::Io { .. })
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

//! The namespace: directories and write-once files, held in memory.
//!
//! A tree of nodes kept in a map by node id; each directory holds its children in a `BTreeMap` by
//! name. That makes every operation cost what it touches: lookup walks the path's components,
//! listing is a sorted range scan from `start_after`, renaming a directory moves one map entry
//! however many files lie below it, and a recursive delete visits exactly the removed subtree.
//! Files are also indexed by file id, because writers address unsealed files by id.
//!
//! Each entry records the tenant that made it (its owner, an index into a table of tenant names
//! so a node carries 4 bytes of it): outside `/jobs` an entry belongs to that tenant
//! (`crate::authz`). The root, `/jobs` and entries made before owners were recorded are
//! everyone's.
//!
//! Durable state (a write-ahead log and snapshots) comes in a later issue; today a restarted
//! metadata server starts with an empty namespace.

use std::collections::{BTreeMap, HashMap};
use std::ops::Bound;

use tern_proto::v1::{EntryKind, FileInfo};
use tern_proto::{BlockId, ErrorKind, FileId, ServerId, StorageClass};

use crate::error::{already_exists, invalid, not_found, Refusal};
use crate::path::{self, Place};

type NodeId = u64;

/// An entry's owning tenant: an index into [`Namespace::owners`]; [`NOBODY`]: everyone's.
type Owner = u32;
const NOBODY: Owner = 0;

/// The root directory's node id; it always exists.
const ROOT: NodeId = 0;

/// One block of a file and the storage server holding it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockRef {
    pub block_id: BlockId,
    pub server_id: ServerId,
}

/// A file's metadata. Files are written once: blocks are appended while unsealed, then fixed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileMeta {
    /// Unique for the life of the server, never reused, so a stale id cannot reach a new file.
    pub file_id: FileId,
    pub sealed: bool,
    /// Bytes; 0 until sealed.
    pub length: u64,
    /// Every copy of every block, grouped by block: block i's copies are
    /// `blocks[i * replicas .. (i + 1) * replicas]`, each on a different server.
    pub blocks: Vec<BlockRef>,
    /// Which tiers its blocks may go to.
    pub storage_class: StorageClass,
    /// Copies of each block (1 or 2), chosen at create.
    pub replicas: u32,
}

impl FileMeta {
    /// The copies of each block, in block order.
    pub fn copies(&self) -> std::slice::Chunks<'_, BlockRef> {
        self.blocks.chunks(self.replicas.max(1) as usize)
    }

    /// Blocks of the file (not counting copies).
    pub fn block_count(&self) -> u64 {
        (self.blocks.len() / self.replicas.max(1) as usize) as u64
    }
}

#[derive(Debug)]
enum Body {
    Dir(BTreeMap<String, NodeId>),
    File(FileMeta),
}

#[derive(Debug)]
struct Node {
    parent: NodeId,
    name: String,
    created_unix_ms: u64,
    owner: Owner,
    body: Body,
}

/// What a removal took out of the namespace, so the caller can free blocks and fix job usage.
#[derive(Debug, Default)]
pub struct Removed {
    pub files: u64,
    pub sealed_bytes: u64,
    pub blocks: Vec<BlockRef>,
}

#[derive(Debug)]
pub struct Namespace {
    nodes: HashMap<NodeId, Node>,
    file_nodes: HashMap<FileId, NodeId>,
    next_node: NodeId,
    next_file_id: FileId,
    files: u64,
    /// Not counting the root.
    directories: u64,
    /// Files plus directories (not counting the root) may not exceed this.
    max_entries: u64,
    /// Owning tenants' names by [`Owner`] (index 0, [`NOBODY`], is ""), and their indexes.
    owners: Vec<String>,
    owner_ids: HashMap<String, Owner>,
}

impl Namespace {
    pub fn new(max_entries: u64) -> Namespace {
        let root = Node {
            parent: ROOT,
            name: String::new(),
            created_unix_ms: 0,
            owner: NOBODY,
            body: Body::Dir(BTreeMap::new()),
        };
        Namespace {
            nodes: HashMap::from([(ROOT, root)]),
            file_nodes: HashMap::new(),
            next_node: ROOT + 1,
            next_file_id: FileId::FIRST,
            files: 0,
            directories: 0,
            max_entries,
            owners: vec![String::new()],
            owner_ids: HashMap::from([(String::new(), NOBODY)]),
        }
    }

    /// The index of tenant `tenant` ("": nobody), added when new.
    fn owner_id(&mut self, tenant: &str) -> Owner {
        if let Some(&id) = self.owner_ids.get(tenant) {
            return id;
        }
        let id = self.owners.len() as Owner;
        self.owners.push(tenant.to_string());
        self.owner_ids.insert(tenant.to_string(), id);
        id
    }

    /// The tenant owning `path` (normalised): that of the deepest entry on the way to it that
    /// has an owner (the entry itself, or for a path not there yet the directory it would be made
    /// in); None when everything on the way is everyone's.
    pub fn owner(&self, path: &str) -> Option<&str> {
        let mut id = ROOT;
        let mut owner = NOBODY;
        for name in path::components(path) {
            let Body::Dir(children) = &self.node(id).body else {
                break;
            };
            let Some(&child) = children.get(name) else {
                break;
            };
            id = child;
            if self.node(id).owner != NOBODY {
                owner = self.node(id).owner;
            }
        }
        (owner != NOBODY).then(|| self.owners[owner as usize].as_str())
    }

    /// The tenant owning file `file_id` (None: everyone's, or no such file).
    pub fn file_owner(&self, file_id: FileId) -> Option<&str> {
        let path = self.file_path(file_id).ok()?;
        self.owner(&path)
    }

    pub fn files(&self) -> u64 {
        self.files
    }

    pub fn directories(&self) -> u64 {
        self.directories
    }

    /// Makes directory `path` (normalised), owned by tenant `owner` ("": everyone's); `parents`
    /// makes missing parents (owned alike) and accepts an existing directory, as `mkdir -p` does.
    pub fn mkdir(&mut self, path: &str, parents: bool, owner: &str, now_unix_ms: u64) -> Result<(), Refusal> {
        if let Some(id) = self.lookup(path) {
            return match (&self.node(id).body, parents) {
                (Body::Dir(_), true) => Ok(()),
                (Body::Dir(_), false) => Err(already_exists("directory already exists")),
                (Body::File(_), _) => Err(already_exists("already exists as a file")),
            };
        }
        let owner = self.owner_id(owner);
        let (parent, name) = self.parent_dir(path, parents, owner, now_unix_ms)?;
        self.insert(parent, name, Body::Dir(BTreeMap::new()), owner, now_unix_ms)?;
        Ok(())
    }

    /// Creates an unsealed, empty file at `path` (normalised), owned by tenant `owner` (as
    /// [`Namespace::mkdir`] says); returns its file id.
    pub fn create_file(
        &mut self,
        path: &str,
        parents: bool,
        storage_class: StorageClass,
        owner: &str,
        now_unix_ms: u64,
    ) -> Result<FileId, Refusal> {
        if self.lookup(path).is_some() {
            return Err(already_exists("already exists"));
        }
        let owner = self.owner_id(owner);
        let (parent, name) = self.parent_dir(path, parents, owner, now_unix_ms)?;
        let file_id = self.next_file_id;
        let meta = FileMeta { file_id, sealed: false, length: 0, blocks: Vec::new(), storage_class, replicas: 1 };
        let node = self.insert(parent, name, Body::File(meta), owner, now_unix_ms)?;
        self.next_file_id = file_id.next();
        self.file_nodes.insert(file_id, node);
        Ok(file_id)
    }

    /// Creates a file as [`Namespace::create_file`] does, under a given id (replaying the log).
    pub fn create_file_as(
        &mut self,
        file_id: FileId,
        path: &str,
        parents: bool,
        storage_class: StorageClass,
        owner: &str,
        now_unix_ms: u64,
    ) -> Result<(), Refusal> {
        let next = self.next_file_id;
        self.next_file_id = file_id;
        let created = self.create_file(path, parents, storage_class, owner, now_unix_ms);
        self.next_file_id = next.max(file_id.next());
        created.map(|_| ())
    }

    /// The next file id to hand out.
    pub fn next_file_id(&self) -> FileId {
        self.next_file_id
    }

    /// Raises the next file id to at least `next` (ids are never reused, across restarts too).
    pub fn raise_next_file_id(&mut self, next: FileId) {
        self.next_file_id = self.next_file_id.max(next);
    }

    /// Every file's blocks.
    pub fn blocks(&self) -> impl Iterator<Item = (&FileMeta, &BlockRef)> {
        self.file_metas().flat_map(|meta| meta.blocks.iter().map(move |block| (meta, block)))
    }

    /// Every file.
    pub fn file_metas(&self) -> impl Iterator<Item = &FileMeta> {
        self.nodes.values().filter_map(|node| match &node.body {
            Body::File(meta) => Some(meta),
            Body::Dir(_) => None,
        })
    }

    /// Every entry below the root, parents before children: (path, creation time, owning tenant
    /// or "", file metadata for files). What a snapshot records.
    pub fn walk(&self) -> Vec<(String, u64, &str, Option<&FileMeta>)> {
        let mut out = Vec::new();
        let mut pending = vec![(ROOT, String::from("/"))];
        while let Some((id, path)) = pending.pop() {
            let Body::Dir(children) = &self.node(id).body else {
                continue;
            };
            // Reversed onto the stack, so entries come out in name order.
            for (name, &child) in children.iter().rev() {
                let child_path = path::join(&path, name);
                let node = self.node(child);
                let owner = self.owners[node.owner as usize].as_str();
                match &node.body {
                    Body::Dir(_) => {
                        out.push((child_path.clone(), node.created_unix_ms, owner, None));
                        pending.push((child, child_path));
                    }
                    Body::File(meta) => out.push((child_path, node.created_unix_ms, owner, Some(meta))),
                }
            }
        }
        out
    }

    /// The entry at `path` (normalised), and its file metadata when it is a file.
    pub fn stat(&self, path: &str) -> Result<(FileInfo, Option<&FileMeta>), Refusal> {
        let id = self.lookup(path).ok_or_else(|| not_found("no such file or directory"))?;
        let meta = match &self.node(id).body {
            Body::File(meta) => Some(meta),
            Body::Dir(_) => None,
        };
        Ok((self.info(id, path.to_string()), meta))
    }

    /// The path of file `file_id`, or NotFound when no such file exists (any more).
    pub fn file_path(&self, file_id: FileId) -> Result<String, Refusal> {
        let id = self.file_node(file_id)?;
        Ok(self.path_of(id))
    }

    /// File `file_id`'s metadata.
    pub fn file(&self, file_id: FileId) -> Result<&FileMeta, Refusal> {
        let id = self.file_node(file_id)?;
        match &self.node(id).body {
            Body::File(meta) => Ok(meta),
            Body::Dir(_) => Err(Refusal::new(ErrorKind::Internal, format!("file id {file_id} names a directory"))),
        }
    }

    /// File `file_id`'s metadata, for appending blocks and sealing.
    pub fn file_mut(&mut self, file_id: FileId) -> Result<&mut FileMeta, Refusal> {
        let id = self.file_node(file_id)?;
        match &mut self.node_mut(id).body {
            Body::File(meta) => Ok(meta),
            Body::Dir(_) => Err(Refusal::new(ErrorKind::Internal, format!("file id {file_id} names a directory"))),
        }
    }

    /// The info of file `file_id` at its current path.
    pub fn file_info(&self, file_id: FileId) -> Result<FileInfo, Refusal> {
        let id = self.file_node(file_id)?;
        Ok(self.info(id, self.path_of(id)))
    }

    /// A directory's children sorted by name, strictly after `start_after`, at most `limit` of
    /// them, and whether more follow; a file lists as itself.
    pub fn list(&self, path: &str, start_after: &str, limit: usize) -> Result<(Vec<FileInfo>, bool), Refusal> {
        let id = self.lookup(path).ok_or_else(|| not_found("no such file or directory"))?;
        let Body::Dir(children) = &self.node(id).body else {
            return Ok((vec![self.info(id, path.to_string())], false));
        };
        let lower = if start_after.is_empty() { Bound::Unbounded } else { Bound::Excluded(start_after) };
        let mut entries = Vec::new();
        for (name, &child) in children.range::<str, _>((lower, Bound::Unbounded)) {
            if entries.len() >= limit {
                return Ok((entries, true));
            }
            entries.push(self.info(child, path::join(path, name)));
        }
        Ok((entries, false))
    }

    /// Removes `path` (normalised) and, when `recursive`, everything below it.
    pub fn remove(&mut self, path: &str, recursive: bool) -> Result<Removed, Refusal> {
        let id = self.lookup(path).ok_or_else(|| not_found("no such file or directory"))?;
        if id == ROOT {
            return Err(invalid("the root directory cannot be deleted"));
        }
        if let Body::Dir(children) = &self.node(id).body {
            if !children.is_empty() && !recursive {
                return Err(invalid(format!(
                    "directory not empty ({} entries); delete it recursively",
                    children.len()
                )));
            }
        }
        self.detach(id);
        // Iterative, not recursive: a deep tree must not overflow the stack.
        let mut removed = Removed::default();
        let mut pending = vec![id];
        while let Some(id) = pending.pop() {
            let Some(node) = self.nodes.remove(&id) else {
                continue;
            };
            match node.body {
                Body::Dir(children) => {
                    self.directories -= 1;
                    pending.extend(children.into_values());
                }
                Body::File(meta) => {
                    self.files -= 1;
                    self.file_nodes.remove(&meta.file_id);
                    removed.files += 1;
                    if meta.sealed {
                        removed.sealed_bytes += meta.length;
                    }
                    removed.blocks.extend(meta.blocks);
                }
            }
        }
        Ok(removed)
    }

    /// Moves `from` to `to` (both normalised), keeping the entry's identity: a file keeps its id
    /// and blocks, a directory its whole subtree.
    pub fn rename(&mut self, from: &str, to: &str) -> Result<(), Refusal> {
        let id = self.lookup(from).ok_or_else(|| not_found(format!("{from} does not exist")))?;
        if id == ROOT {
            return Err(invalid("the root directory cannot be renamed"));
        }
        if self.lookup(to).is_some() {
            return Err(already_exists(format!("{to} already exists")));
        }
        if path::is_within(to, from) {
            return Err(invalid(format!("cannot move {from} into itself")));
        }
        let Some((parent_path, name)) = path::split_last(to) else {
            return Err(already_exists("/ already exists"));
        };
        let parent = self.lookup(parent_path).ok_or_else(|| not_found(format!("{parent_path} does not exist")))?;
        if !matches!(self.node(parent).body, Body::Dir(_)) {
            return Err(invalid(format!("{parent_path} is a file, not a directory")));
        }
        self.detach(id);
        if let Body::Dir(children) = &mut self.node_mut(parent).body {
            children.insert(name.to_string(), id);
        }
        let node = self.node_mut(id);
        node.parent = parent;
        node.name = name.to_string();
        Ok(())
    }

    fn lookup(&self, path: &str) -> Option<NodeId> {
        let mut id = ROOT;
        for name in path::components(path) {
            let Body::Dir(children) = &self.node(id).body else {
                return None;
            };
            id = *children.get(name)?;
        }
        Some(id)
    }

    /// The directory that is to hold `path`, made (with its parents) when `parents` is set, and
    /// the new entry's name.
    fn parent_dir<'p>(
        &mut self,
        path: &'p str,
        parents: bool,
        owner: Owner,
        now_unix_ms: u64,
    ) -> Result<(NodeId, &'p str), Refusal> {
        let (parent_path, name) = path::split_last(path).ok_or_else(|| already_exists("/ always exists"))?;
        let mut id = ROOT;
        let mut walked = String::new();
        for component in path::components(parent_path) {
            walked.push('/');
            walked.push_str(component);
            let child = match &self.node(id).body {
                Body::Dir(children) => children.get(component).copied(),
                Body::File(_) => None,
            };
            id = match child {
                Some(child) if matches!(self.node(child).body, Body::Dir(_)) => child,
                Some(_) => return Err(invalid(format!("{walked} is a file, not a directory"))),
                None if parents => self.insert(id, component, Body::Dir(BTreeMap::new()), owner, now_unix_ms)?,
                None => return Err(not_found(format!("parent directory {walked} does not exist"))),
            };
        }
        Ok((id, name))
    }

    /// Adds a child to directory `parent`, within the namespace's size limit.
    fn insert(
        &mut self,
        parent: NodeId,
        name: &str,
        body: Body,
        owner: Owner,
        now_unix_ms: u64,
    ) -> Result<NodeId, Refusal> {
        if self.files + self.directories >= self.max_entries {
            return Err(Refusal::new(
                ErrorKind::OutOfSpace,
                format!("the namespace holds {} entries, its limit (max_entries); delete some first", self.max_entries),
            ));
        }
        let id = self.next_node;
        self.next_node += 1;
        match &body {
            Body::Dir(_) => self.directories += 1,
            Body::File(_) => self.files += 1,
        }
        if let Body::Dir(children) = &mut self.node_mut(parent).body {
            children.insert(name.to_string(), id);
        }
        self.nodes.insert(id, Node { parent, name: name.to_string(), created_unix_ms: now_unix_ms, owner, body });
        Ok(id)
    }

    /// Unlinks `id` from its parent directory (the node itself stays in the map).
    fn detach(&mut self, id: NodeId) {
        let node = self.node(id);
        let (parent, name) = (node.parent, node.name.clone());
        if let Body::Dir(children) = &mut self.node_mut(parent).body {
            children.remove(&name);
        }
    }

    fn path_of(&self, mut id: NodeId) -> String {
        let mut names = Vec::new();
        while id != ROOT {
            let node = self.node(id);
            names.push(node.name.as_str());
            id = node.parent;
        }
        if names.is_empty() {
            return "/".to_string();
        }
        names.iter().rev().fold(String::new(), |path, name| path + "/" + name)
    }

    fn info(&self, id: NodeId, path: String) -> FileInfo {
        let node = self.node(id);
        let job = Place::of(&path).job().unwrap_or_default().to_string();
        let mut info = FileInfo { path, created_unix_ms: node.created_unix_ms, job, ..FileInfo::default() };
        match &node.body {
            Body::Dir(_) => {
                info.kind = EntryKind::Directory as i32;
                info.sealed = true;
            }
            Body::File(meta) => {
                info.kind = EntryKind::File as i32;
                info.sealed = meta.sealed;
                info.length = meta.length;
                info.file_id = meta.file_id.get();
                info.block_count = meta.block_count();
                info.storage_class = meta.storage_class.name().to_string();
                info.replicas = meta.replicas;
            }
        }
        info
    }

    fn file_node(&self, file_id: FileId) -> Result<NodeId, Refusal> {
        self.file_nodes
            .get(&file_id)
            .copied()
            .ok_or_else(|| not_found(format!("file {file_id} does not exist (never created, or deleted)")))
    }

    // Node ids come only from the tree itself, so a missing one is a broken invariant, not bad input.
    fn node(&self, id: NodeId) -> &Node {
        self.nodes.get(&id).expect("namespace invariant: every linked node id is live")
    }

    fn node_mut(&mut self, id: NodeId) -> &mut Node {
        self.nodes.get_mut(&id).expect("namespace invariant: every linked node id is live")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(entries: &[FileInfo]) -> Vec<&str> {
        entries.iter().map(|e| e.path.as_str()).collect()
    }

    #[test]
    fn mkdir_and_create() {
        let mut ns = Namespace::new(100);
        ns.mkdir("/a", false, "", 1).unwrap();
        assert_eq!(ns.mkdir("/a", false, "", 1).unwrap_err().kind, ErrorKind::AlreadyExists);
        ns.mkdir("/a", true, "", 1).unwrap();
        assert_eq!(ns.mkdir("/x/y", false, "", 1).unwrap_err().kind, ErrorKind::NotFound);
        ns.mkdir("/x/y", true, "", 1).unwrap();
        let id = ns.create_file("/a/f", false, StorageClass::Any, "", 2).unwrap();
        assert_eq!(ns.create_file("/a/f", false, StorageClass::Any, "", 2).unwrap_err().kind, ErrorKind::AlreadyExists);
        assert_eq!(ns.create_file("/a", false, StorageClass::Any, "", 2).unwrap_err().kind, ErrorKind::AlreadyExists);
        assert_eq!(ns.mkdir("/a/f", true, "", 2).unwrap_err().kind, ErrorKind::AlreadyExists);
        assert_eq!(ns.create_file("/a/f/g", true, StorageClass::Any, "", 2).unwrap_err().kind, ErrorKind::Invalid);
        assert_eq!(ns.create_file("/b/c/f", false, StorageClass::Any, "", 2).unwrap_err().kind, ErrorKind::NotFound);
        let id2 = ns.create_file("/b/c/f", true, StorageClass::Any, "", 2).unwrap();
        assert!(id2 > id);
        assert_eq!((ns.files(), ns.directories()), (2, 5));
        let (info, meta) = ns.stat("/a/f").unwrap();
        assert_eq!(info.kind, EntryKind::File as i32);
        assert!(!info.sealed);
        assert_eq!(info.created_unix_ms, 2);
        assert_eq!(meta.unwrap().file_id, id);
        let (info, meta) = ns.stat("/").unwrap();
        assert_eq!((info.kind, info.sealed, meta), (EntryKind::Directory as i32, true, None));
        assert_eq!(ns.file_path(id2).unwrap(), "/b/c/f");
        assert_eq!(ns.stat("/nope").unwrap_err().kind, ErrorKind::NotFound);
    }

    #[test]
    fn lists_sorted_in_pages() {
        let mut ns = Namespace::new(100);
        for name in ["d", "b", "a", "e", "c"] {
            ns.create_file(&format!("/dir/{name}"), true, StorageClass::Any, "", 0).unwrap();
        }
        let (page, truncated) = ns.list("/dir", "", 2).unwrap();
        assert_eq!((names(&page), truncated), (vec!["/dir/a", "/dir/b"], true));
        let (page, truncated) = ns.list("/dir", "b", 2).unwrap();
        assert_eq!((names(&page), truncated), (vec!["/dir/c", "/dir/d"], true));
        let (page, truncated) = ns.list("/dir", "d", 2).unwrap();
        assert_eq!((names(&page), truncated), (vec!["/dir/e"], false));
        let (page, truncated) = ns.list("/dir", "bb", 10).unwrap();
        assert_eq!((names(&page), truncated), (vec!["/dir/c", "/dir/d", "/dir/e"], false));
        let (page, _) = ns.list("/dir/c", "", 10).unwrap();
        assert_eq!(names(&page), vec!["/dir/c"]);
        let (page, _) = ns.list("/", "", 10).unwrap();
        assert_eq!(names(&page), vec!["/dir"]);
        assert_eq!(ns.list("/missing", "", 10).unwrap_err().kind, ErrorKind::NotFound);
    }

    #[test]
    fn removes_recursively_only_when_asked() {
        let mut ns = Namespace::new(100);
        let a = ns.create_file("/d/a", true, StorageClass::Any, "", 0).unwrap();
        ns.create_file("/d/sub/b", true, StorageClass::Any, "", 0).unwrap();
        let meta = ns.file_mut(a).unwrap();
        let block = |id| BlockRef { block_id: BlockId::from_wire(id), server_id: ServerId::from_wire(id) };
        meta.blocks = vec![block(1), block(2)];
        meta.sealed = true;
        meta.length = 10;
        let refusal = ns.remove("/d", false).unwrap_err();
        assert_eq!(refusal.kind, ErrorKind::Invalid);
        assert!(refusal.reason.contains("not empty"), "{}", refusal.reason);
        assert_eq!(ns.remove("/", true).unwrap_err().kind, ErrorKind::Invalid);
        let removed = ns.remove("/d", true).unwrap();
        assert_eq!((removed.files, removed.sealed_bytes, removed.blocks.len()), (2, 10, 2));
        assert_eq!((ns.files(), ns.directories()), (0, 0));
        assert_eq!(ns.file_path(a).unwrap_err().kind, ErrorKind::NotFound);
        assert_eq!(ns.remove("/d", true).unwrap_err().kind, ErrorKind::NotFound);
        ns.mkdir("/empty", false, "", 0).unwrap();
        ns.remove("/empty", false).unwrap();
        assert_eq!(ns.directories(), 0);
    }

    #[test]
    fn renames_directories_with_descendants() {
        let mut ns = Namespace::new(100);
        let id = ns.create_file("/a/b/c/f", true, StorageClass::Any, "", 0).unwrap();
        ns.mkdir("/z", false, "", 0).unwrap();
        ns.rename("/a/b", "/z/moved").unwrap();
        assert_eq!(ns.file_path(id).unwrap(), "/z/moved/c/f");
        assert_eq!(ns.stat("/z/moved/c/f").unwrap().1.unwrap().file_id, id);
        assert_eq!(ns.stat("/a/b").unwrap_err().kind, ErrorKind::NotFound);
        let (page, _) = ns.list("/a", "", 10).unwrap();
        assert!(page.is_empty());
        assert_eq!(ns.rename("/z", "/z/moved/c/inside").unwrap_err().kind, ErrorKind::Invalid);
        assert_eq!(ns.rename("/z", "/z").unwrap_err().kind, ErrorKind::AlreadyExists);
        assert_eq!(ns.rename("/z/moved", "/a").unwrap_err().kind, ErrorKind::AlreadyExists);
        assert_eq!(ns.rename("/missing", "/m").unwrap_err().kind, ErrorKind::NotFound);
        assert_eq!(ns.rename("/z", "/nope/z").unwrap_err().kind, ErrorKind::NotFound);
        assert_eq!(ns.rename("/z", "/z/moved/c/f/x").unwrap_err().kind, ErrorKind::Invalid);
        assert_eq!(ns.rename("/", "/root").unwrap_err().kind, ErrorKind::Invalid);
        // A file can be renamed onto a fresh name beside itself.
        ns.rename("/z/moved/c/f", "/z/moved/c/g").unwrap();
        assert_eq!(ns.file_path(id).unwrap(), "/z/moved/c/g");
        let removed = ns.remove("/z", true).unwrap();
        assert_eq!(removed.files, 1);
        assert_eq!((ns.files(), ns.directories()), (0, 1));
    }

    #[test]
    fn refuses_past_max_entries() {
        let mut ns = Namespace::new(3);
        ns.create_file("/a/b/f", true, StorageClass::Any, "", 0).unwrap();
        let refusal = ns.create_file("/a/g", false, StorageClass::Any, "", 0).unwrap_err();
        assert_eq!(refusal.kind, ErrorKind::OutOfSpace);
        assert!(refusal.reason.contains("max_entries"), "{}", refusal.reason);
        ns.remove("/a/b", true).unwrap();
        ns.create_file("/a/g", false, StorageClass::Any, "", 0).unwrap();
    }

    #[test]
    fn entries_belong_to_their_maker_and_the_way_to_them_says_whose_a_new_one_is() {
        let mut ns = Namespace::new(100);
        assert_eq!(ns.owner("/"), None, "the root is everyone's");
        ns.mkdir("/etl/in", true, "etl", 1).unwrap();
        let file = ns.create_file("/etl/in/f", false, StorageClass::Any, "etl", 1).unwrap();
        ns.mkdir("/legacy", false, "", 1).unwrap();
        assert_eq!(ns.owner("/etl"), Some("etl"), "parents made by -p are the maker's too");
        assert_eq!(ns.owner("/etl/in/f"), Some("etl"));
        assert_eq!(ns.file_owner(file), Some("etl"));
        assert_eq!(ns.owner("/etl/in/not-yet"), Some("etl"), "a new entry's is its directory's");
        assert_eq!(ns.owner("/legacy/x"), None);
        assert_eq!(ns.owner("/nothing/here"), None);
        // Moved, an entry keeps its owner; snapshots carry it.
        ns.rename("/etl/in/f", "/legacy/f").unwrap();
        assert_eq!(ns.owner("/legacy/f"), Some("etl"));
        let walked: Vec<(String, &str)> = ns.walk().into_iter().map(|(path, _, owner, _)| (path, owner)).collect();
        assert!(walked.contains(&("/legacy/f".to_string(), "etl")), "{walked:?}");
        assert!(walked.contains(&("/legacy".to_string(), "")), "{walked:?}");
    }
}

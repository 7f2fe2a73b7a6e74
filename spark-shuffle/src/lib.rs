//! The native half of Tern's Spark shuffle plugin: tern-client's shuffle API over JNI, for the
//! Java class `io.tern.spark.TernNative`.
//!
//! Rules every entry point keeps:
//! - **Opaque handles.** Native state crosses as a `jlong` made by `Box::into_raw`; Java frees it
//!   with the matching `close*` call, exactly once. A zero handle is refused, never dereferenced.
//! - **Shared handles are borrowed shared.** Java shares client, job and shuffle handles between
//!   threads, so they are only ever borrowed `&` ([`shared`], which requires `Sync`); only the
//!   writer and reader handles, each used by one thread at a time, are borrowed `&mut`
//!   ([`exclusive`]). See [`shared`] for which Java objects hold which handle.
//! - **Nothing unwinds into the JVM.** Each entry point runs under `catch_unwind`; an error or a
//!   panic becomes a thrown `io.tern.spark.TernException` carrying the message and the error kind
//!   (`data-lost`, `not-found`, ... as in `tern_proto::ErrorKind::name`, or `panic`); an
//!   `out-of-space` one is thrown as its subclass `io.tern.spark.TernOutOfSpaceException`.
//! - **One call back into Java**: a map writer waiting for space calls the static
//!   `TernNative.spaceWait(String)` from a runtime thread (attached to the JVM as a daemon), so
//!   Spark's driver can be asked to free what it no longer needs while the push waits.
//! - **Zero copy.** Data goes in and out as direct ByteBuffers: a write reads the caller's buffer
//!   in place; a read hands Java a direct buffer over the fetched bytes, valid until the next
//!   `nextBatch` or `closeReader` on that reader.
//! - **One runtime per process**, created on first use; calls block the calling Java thread on it.

// The JNI boundary is unsafe by nature: handles are raw pointers owned by Java, and direct
// buffers are raw memory. Every unsafe block below says why it is sound.
#![allow(unsafe_code)]

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use jni::objects::{GlobalRef, JByteBuffer, JClass, JIntArray, JObject, JString, JValue};
use jni::sys::{jint, jintArray, jlong, jlongArray, jobject, jstring};
use jni::{JNIEnv, JavaVM};
use tern_client::{
    Client, ClientOptions, ErrorKind, JobSession, MapWriter, MapWriterOptions, PemOrigin, Shuffle, ShuffleId,
    ShuffleOptions, ShuffleReader, SpaceWait, TlsMaterial,
};

mod scheduler;

const EXCEPTION_CLASS: &str = "io/tern/spark/TernException";
/// Thrown instead of [`EXCEPTION_CLASS`] for `out-of-space`, so Java can tell it apart by type.
const OUT_OF_SPACE_CLASS: &str = "io/tern/spark/TernOutOfSpaceException";
/// The class whose static `spaceWait(String)` a waiting push calls.
const NATIVE_CLASS: &str = "io/tern/spark/TernNative";

/// An error on its way to Java: a kind (`ErrorKind::name`, or `panic`/`jni`) and a message.
struct Failure {
    kind: String,
    message: String,
}

impl From<tern_client::Error> for Failure {
    fn from(e: tern_client::Error) -> Failure {
        Failure { kind: e.kind().name().to_string(), message: e.message().to_string() }
    }
}

impl From<jni::errors::Error> for Failure {
    fn from(e: jni::errors::Error) -> Failure {
        Failure { kind: "jni".into(), message: e.to_string() }
    }
}

fn invalid(message: impl Into<String>) -> Failure {
    Failure { kind: ErrorKind::Invalid.name().into(), message: message.into() }
}

type Outcome<T> = Result<T, Failure>;

/// The process's runtime. Its workers run the pushes and fetches in the background; a JNI call
/// blocks its own (Java) thread until its future completes. Threads: `TERN_SPARK_THREADS`, else 2.
fn runtime() -> &'static tokio::runtime::Runtime {
    static RUNTIME: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RUNTIME.get_or_init(|| {
        let threads = std::env::var("TERN_SPARK_THREADS").ok().and_then(|t| t.parse().ok()).unwrap_or(2usize);
        let _ = tracing_subscriber::fmt()
            .with_env_filter(
                tracing_subscriber::EnvFilter::try_from_env("TERN_SPARK_LOG")
                    .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
            )
            .with_writer(std::io::stderr)
            .try_init();
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads.max(1))
            .thread_name("tern-spark")
            .enable_all()
            .build()
            .expect("building the tern-spark tokio runtime")
    })
}

/// Runs `body`, turning an error or a panic into a pending Java exception and returning
/// `T::default()` (which Java never sees, since the exception is thrown on return).
fn entry<'local, T: Default>(env: &mut JNIEnv<'local>, body: impl FnOnce(&mut JNIEnv<'local>) -> Outcome<T>) -> T {
    let result = catch_unwind(AssertUnwindSafe(|| body(env)));
    let failure = match result {
        Ok(Ok(value)) => return value,
        Ok(Err(failure)) => failure,
        Err(panic) => {
            let message = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            Failure { kind: "panic".into(), message: format!("tern-spark native code panicked: {message}") }
        }
    };
    throw(env, &failure);
    T::default()
}

fn throw(env: &mut JNIEnv, failure: &Failure) {
    if env.exception_check().unwrap_or(false) {
        return; // a Java exception (from a callback) is already on its way
    }
    let thrown = (|| -> jni::errors::Result<()> {
        let kind = env.new_string(&failure.kind)?;
        let message = env.new_string(&failure.message)?;
        let class = if failure.kind == ErrorKind::OutOfSpace.name() { OUT_OF_SPACE_CLASS } else { EXCEPTION_CLASS };
        let exception = env.new_object(
            class,
            "(Ljava/lang/String;Ljava/lang/String;)V",
            &[JValue::Object(&kind), JValue::Object(&message)],
        )?;
        env.throw(jni::objects::JThrowable::from(exception))
    })();
    if thrown.is_err() {
        let _ = env.exception_clear();
        let _ = env.throw_new("java/lang/RuntimeException", format!("{} ({})", failure.message, failure.kind));
    }
}

fn into_handle<T>(value: T) -> jlong {
    Box::into_raw(Box::new(value)) as jlong
}

/// Borrows, shared, the object behind a handle that Java uses from many threads at once.
///
/// Thread safety: the handles borrowed this way are shared across Java threads, and nothing here
/// may assume otherwise.
/// - A `Client` handle is held by the process's one `TernShuffleManager` (driver or executor) and
///   used by every task thread of the JVM at once (`addJobToken`, `openShuffle`,
///   `registerShuffle`, `startJob`), outside the manager's lock.
/// - A `Shuffle` handle is opened once per process and kept in the manager's `shuffles` map; every
///   map and reduce task of that shuffle running in the JVM uses it concurrently (`openWriter`,
///   `openReader`, `lostMaps`, `invalidateMaps`), and the driver's endpoint thread too.
/// - A `JobSession` handle lives on the driver's manager; its calls run under the manager's lock,
///   but that lock is Java's, not a promise this side can check.
///
/// So these are borrowed `&` only, never `&mut` (two `&mut` at once would be undefined behaviour
/// even if both only read). That is sound because every method Java reaches on them takes `&self`
/// and the types are `Sync` (the bound makes the compiler check it): their mutable state (job
/// tokens, connection pools, a shuffle's current segments) sits behind their own locks and
/// atomics. Closing such a handle while another thread uses it would be a use after free: Java
/// closes a shuffle only once Spark has unregistered it (no task of it runs any more) or the
/// manager stops, and the client last, in `stop`.
///
/// # Safety
/// `handle` must come from `into_handle::<T>` and not have been closed.
unsafe fn shared<'a, T: Sync>(handle: jlong) -> Outcome<&'a T> {
    if handle == 0 {
        return Err(invalid("a closed or null native handle was used"));
    }
    // SAFETY: the caller promises a live `Box<T>` made by `into_handle::<T>`; it is only ever
    // borrowed shared, and `T: Sync` makes concurrent shared borrows from several threads sound.
    Ok(unsafe { &*(handle as *const T) })
}

/// Borrows, exclusively, the object behind a handle that one thread at a time uses: a `Writer`
/// (owned by one `TernShuffleWriter`, which one task thread drives from open to close) or a
/// `Reader` (owned by one `TernShuffleReader` iterator, consumed by its task thread, and closed by
/// that task's completion listener, which Spark runs on the same thread when the task ends).
///
/// # Safety
/// `handle` must come from `into_handle::<T>`, not have been closed, and no other borrow of it
/// may be live: Java uses it from one thread at a time.
unsafe fn exclusive<'a, T: Send>(handle: jlong) -> Outcome<&'a mut T> {
    if handle == 0 {
        return Err(invalid("a closed or null native handle was used"));
    }
    // SAFETY: the caller promises a live `Box<T>` and that no other borrow of it is live.
    Ok(unsafe { &mut *(handle as *mut T) })
}

/// Frees the object behind a handle; zero is ignored.
///
/// # Safety
/// `handle` must come from `into_handle::<T>`, not have been closed, and no thread may use it
/// any more; afterwards the handle must not be used again.
unsafe fn close<T>(handle: jlong) {
    if handle != 0 {
        // SAFETY: the caller promises a live `Box<T>` that nothing else uses.
        drop(unsafe { Box::from_raw(handle as *mut T) });
    }
}

fn string(env: &mut JNIEnv, s: &JString) -> Outcome<String> {
    if s.is_null() {
        return Ok(String::new());
    }
    Ok(env.get_string(s)?.into())
}

fn range(start: jint, end: jint) -> Outcome<std::ops::Range<u32>> {
    if start < 0 || end < start {
        return Err(invalid(format!("bad range [{start}, {end})")));
    }
    Ok(start as u32..end as u32)
}

struct Reader {
    reader: ShuffleReader,
    /// The batch Java is looking at: kept alive while its direct buffer is in use.
    current: Option<Bytes>,
}

struct Writer {
    writer: Option<MapWriter>,
}

// ---- clients and jobs -------------------------------------------------------------------------

/// Connects to the metadata server. Every string may be empty (unset): `transport` is `auto`
/// then; TLS material comes from `tls_dir`, or from the three PEM texts (all three or none), or
/// is absent (a trusted network); `tenant` is the tenant the application's job counts against
/// ("": the credential's); `credential_file` holds the credential it acts with (a client of its
/// tenant; "": none, a client of the default tenant).
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub extern "system" fn Java_io_tern_spark_TernNative_connect<'l>(
    mut env: JNIEnv<'l>,
    _: JClass<'l>,
    addr: JString<'l>,
    transport: JString<'l>,
    tls_dir: JString<'l>,
    ca_pem: JString<'l>,
    cert_pem: JString<'l>,
    key_pem: JString<'l>,
    tenant: JString<'l>,
    credential_file: JString<'l>,
) -> jlong {
    entry(&mut env, |env| {
        let addr = string(env, &addr)?;
        let transport = string(env, &transport)?;
        let mut options = ClientOptions::default();
        let tenant = string(env, &tenant)?;
        if !tenant.is_empty() {
            options.tenant = tenant;
        }
        if let Some(credential) = credential_setting(env, &credential_file)? {
            options.credential = Some(credential);
        }
        if !transport.is_empty() {
            options.transport = transport.parse().map_err(|e| invalid(format!("spark.tern.transport: {e}")))?;
        }
        let tls = tls_settings(env, &tls_dir, [&ca_pem, &cert_pem, &key_pem])?;
        let client = runtime().block_on(Client::connect_with_tls(&addr, options, tls))?;
        Ok(into_handle(client))
    })
}

/// The credential in the file `spark.tern.credentialFile` names ("": none).
pub(crate) fn credential_setting(env: &mut JNIEnv, file: &JString) -> Outcome<Option<String>> {
    let file = string(env, file)?;
    if file.is_empty() {
        return Ok(None);
    }
    let credential = tern_proto::identity::load_credential(std::path::Path::new(&file))
        .map_err(|e| invalid(format!("spark.tern.credentialFile: {e}")))?;
    Ok(Some(credential))
}

/// The version of the functions this library exports to Java, which the jar's
/// `NativeLibrary.ABI` must equal: JNI binds by name only, so a stale library on
/// `java.library.path` would otherwise be called with arguments it does not take.
const JNI_ABI: jint = 2;

#[no_mangle]
pub extern "system" fn Java_io_tern_spark_NativeLibrary_abi<'l>(_: JNIEnv<'l>, _: JClass<'l>) -> jint {
    JNI_ABI
}

/// [`tls_material`] of the settings as Java passes them (directory, then CA, cert and key PEM).
pub(crate) fn tls_settings(
    env: &mut JNIEnv,
    dir: &JString,
    [ca, cert, key]: [&JString; 3],
) -> Outcome<Option<TlsMaterial>> {
    let pem = [string(env, ca)?, string(env, cert)?, string(env, key)?];
    tls_material(&string(env, dir)?, pem)
}

/// The TLS material named by the plugin's settings (their names are in `TernConf.java`).
fn tls_material(dir: &str, [ca, cert, key]: [String; 3]) -> Outcome<Option<TlsMaterial>> {
    let given = [&ca, &cert, &key].iter().filter(|pem| !pem.is_empty()).count();
    if !dir.is_empty() && given > 0 {
        return Err(invalid("give either spark.tern.tlsDir or the spark.tern.tls.* PEM settings, not both"));
    }
    let material = if !dir.is_empty() {
        TlsMaterial::load(std::path::Path::new(dir)).map_err(|e| invalid(format!("spark.tern.tlsDir: {e:#}")))?
    } else if given == 0 {
        return Ok(None);
    } else if given < 3 {
        return Err(invalid(
            "spark.tern.tls.ca, spark.tern.tls.cert and spark.tern.tls.secretKey go together: give all three \
             (the PEM texts of ca.pem, node.pem and node.key from `tern cert init`) or none",
        ));
    } else {
        let origin = PemOrigin {
            ca: "spark.tern.tls.ca".into(),
            node: "spark.tern.tls.cert".into(),
            key: "spark.tern.tls.secretKey".into(),
            renew: "make new material with `tern cert init` and give its files' text again".into(),
        };
        TlsMaterial::from_pem(ca.into_bytes(), cert.into_bytes(), key.into_bytes(), &origin)
            .map_err(|e| invalid(format!("{e:#}")))?
    };
    Ok(Some(material))
}

#[no_mangle]
pub extern "system" fn Java_io_tern_spark_TernNative_closeClient<'l>(_: JNIEnv<'l>, _: JClass<'l>, client: jlong) {
    // SAFETY: the handle came from `connect` and Java closes it once.
    let _ = catch_unwind(|| unsafe { close::<Client>(client) });
}

#[no_mangle]
pub extern "system" fn Java_io_tern_spark_TernNative_startJob<'l>(
    mut env: JNIEnv<'l>,
    _: JClass<'l>,
    client: jlong,
    name: JString<'l>,
    lease_ms: jlong,
) -> jlong {
    entry(&mut env, |env| {
        // SAFETY: a live client handle (see `shared`).
        let client = unsafe { shared::<Client>(client)? }.clone();
        let name = string(env, &name)?;
        let lease = Duration::from_millis(lease_ms.max(1) as u64);
        let job = runtime().block_on(client.start_job((!name.is_empty()).then_some(name.as_str()), lease))?;
        Ok(into_handle(job))
    })
}

#[no_mangle]
pub extern "system" fn Java_io_tern_spark_TernNative_jobId<'l>(
    mut env: JNIEnv<'l>,
    _: JClass<'l>,
    job: jlong,
) -> jstring {
    entry(&mut env, |env| {
        // SAFETY: a live job handle.
        let job = unsafe { shared::<JobSession>(job)? };
        Ok(env.new_string(job.id())?.into_raw())
    })
}

/// The job's token (text form): shuffle handles carry it to executors.
#[no_mangle]
pub extern "system" fn Java_io_tern_spark_TernNative_jobToken<'l>(
    mut env: JNIEnv<'l>,
    _: JClass<'l>,
    job: jlong,
) -> jstring {
    entry(&mut env, |env| {
        // SAFETY: a live job handle.
        let job = unsafe { shared::<JobSession>(job)? };
        Ok(env.new_string(job.token())?.into_raw())
    })
}

/// Gives the client a job's token (from a shuffle handle): its pushes and fetches need it.
#[no_mangle]
pub extern "system" fn Java_io_tern_spark_TernNative_addJobToken<'l>(
    mut env: JNIEnv<'l>,
    _: JClass<'l>,
    client: jlong,
    token: JString<'l>,
) {
    entry(&mut env, |env| {
        // SAFETY: a live client handle.
        let client = unsafe { shared::<Client>(client)? };
        let token = string(env, &token)?;
        client.add_job_token(&token)?;
        Ok(())
    })
}

/// The freshest token the client holds for a job it was given the token of (`addJobToken`): the
/// client refreshes such tokens as they near expiry.
#[no_mangle]
pub extern "system" fn Java_io_tern_spark_TernNative_clientJobToken<'l>(
    mut env: JNIEnv<'l>,
    _: JClass<'l>,
    client: jlong,
    job_id: JString<'l>,
) -> jstring {
    entry(&mut env, |env| {
        // SAFETY: a live client handle.
        let client = unsafe { shared::<Client>(client)? };
        let job_id = string(env, &job_id)?;
        let token =
            client.job_token(&job_id).ok_or_else(|| invalid(format!("the client holds no token of job {job_id}")))?;
        Ok(env.new_string(token)?.into_raw())
    })
}

/// Ends the job (freeing everything under it) and frees the handle.
#[no_mangle]
pub extern "system" fn Java_io_tern_spark_TernNative_endJob<'l>(mut env: JNIEnv<'l>, _: JClass<'l>, job: jlong) {
    entry(&mut env, |_| {
        if job == 0 {
            return Err(invalid("endJob on a closed job handle"));
        }
        // SAFETY: a live job handle, consumed here; Java drops its copy.
        let job = unsafe { Box::from_raw(job as *mut JobSession) };
        runtime().block_on(job.end())?;
        Ok(())
    })
}

/// Stops renewing the job's lease without ending it (as a crashed driver would): the metadata
/// server frees the job's data when the lease lapses. Frees the handle.
#[no_mangle]
pub extern "system" fn Java_io_tern_spark_TernNative_abandonJob<'l>(mut env: JNIEnv<'l>, _: JClass<'l>, job: jlong) {
    entry(&mut env, |_| {
        if job == 0 {
            return Err(invalid("abandonJob on a closed job handle"));
        }
        // SAFETY: a live job handle, consumed here.
        let job = unsafe { Box::from_raw(job as *mut JobSession) };
        let _guard = runtime().enter();
        job.abandon();
        Ok(())
    })
}

// ---- shuffles ---------------------------------------------------------------------------------

#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub extern "system" fn Java_io_tern_spark_TernNative_registerShuffle<'l>(
    mut env: JNIEnv<'l>,
    _: JClass<'l>,
    client: jlong,
    job_id: JString<'l>,
    partitions: jint,
    maps: jint,
    storage_class: JString<'l>,
    split_size_bytes: jlong,
    copies: jint,
) -> jlong {
    entry(&mut env, |env| {
        // SAFETY: a live client handle.
        let client = unsafe { shared::<Client>(client)? }.clone();
        let job_id = string(env, &job_id)?;
        if partitions <= 0 || maps < 0 || split_size_bytes < 0 || !(1..=2).contains(&copies) {
            return Err(invalid(format!(
                "registerShuffle: {partitions} partitions, {maps} maps, split {split_size_bytes}, {copies} copies"
            )));
        }
        let options = ShuffleOptions {
            maps: maps as u32,
            storage_class: string(env, &storage_class)?,
            split_size_bytes: split_size_bytes as u64,
            replicas: copies as u32,
        };
        let shuffle = runtime().block_on(client.register_shuffle(&job_id, partitions as u32, options))?;
        Ok(into_handle(shuffle))
    })
}

#[no_mangle]
pub extern "system" fn Java_io_tern_spark_TernNative_openShuffle<'l>(
    mut env: JNIEnv<'l>,
    _: JClass<'l>,
    client: jlong,
    shuffle_id: jlong,
) -> jlong {
    entry(&mut env, |_| {
        // SAFETY: a live client handle.
        let client = unsafe { shared::<Client>(client)? }.clone();
        let shuffle = runtime().block_on(client.open_shuffle(ShuffleId::from_wire(shuffle_id as u64)))?;
        Ok(into_handle(shuffle))
    })
}

#[no_mangle]
pub extern "system" fn Java_io_tern_spark_TernNative_shuffleId<'l>(
    mut env: JNIEnv<'l>,
    _: JClass<'l>,
    shuffle: jlong,
) -> jlong {
    // SAFETY: a live shuffle handle.
    entry(&mut env, |_| Ok(unsafe { shared::<Shuffle>(shuffle)? }.id().get() as jlong))
}

#[no_mangle]
pub extern "system" fn Java_io_tern_spark_TernNative_unregisterShuffle<'l>(
    mut env: JNIEnv<'l>,
    _: JClass<'l>,
    shuffle: jlong,
) {
    entry(&mut env, |_| {
        // SAFETY: a live shuffle handle.
        let shuffle = unsafe { shared::<Shuffle>(shuffle)? };
        Ok(runtime().block_on(shuffle.unregister())?)
    })
}

#[no_mangle]
pub extern "system" fn Java_io_tern_spark_TernNative_closeShuffle<'l>(_: JNIEnv<'l>, _: JClass<'l>, shuffle: jlong) {
    // SAFETY: a shuffle handle, closed once.
    let _ = catch_unwind(|| unsafe { close::<Shuffle>(shuffle) });
}

/// Map indexes in `[start_map, end_map)` whose committed output has bytes of partitions
/// `[start_partition, end_partition)` on a lost server.
#[no_mangle]
pub extern "system" fn Java_io_tern_spark_TernNative_lostMaps<'l>(
    mut env: JNIEnv<'l>,
    _: JClass<'l>,
    shuffle: jlong,
    start_partition: jint,
    end_partition: jint,
    start_map: jint,
    end_map: jint,
) -> jintArray {
    entry(&mut env, |env| {
        // SAFETY: a live shuffle handle.
        let shuffle = unsafe { shared::<Shuffle>(shuffle)? };
        let (partitions, maps) = (range(start_partition, end_partition)?, range(start_map, end_map)?);
        let lost = runtime().block_on(shuffle.lost_maps(partitions, maps))?;
        let lost: Vec<jint> = lost.into_iter().map(|m| m as jint).collect();
        let array = env.new_int_array(lost.len() as jint)?;
        env.set_int_array_region(&array, 0, &lost)?;
        Ok(array.into_raw())
    })
}

#[no_mangle]
pub extern "system" fn Java_io_tern_spark_TernNative_invalidateMaps<'l>(
    mut env: JNIEnv<'l>,
    _: JClass<'l>,
    shuffle: jlong,
    maps: JIntArray<'l>,
) -> jint {
    entry(&mut env, |env| {
        // SAFETY: a live shuffle handle.
        let shuffle = unsafe { shared::<Shuffle>(shuffle)? };
        let mut buf = vec![0; env.get_array_length(&maps)? as usize];
        env.get_int_array_region(&maps, 0, &mut buf)?;
        let maps: Vec<u32> = buf.into_iter().map(|m| m as u32).collect();
        Ok(runtime().block_on(shuffle.invalidate_maps(&maps))? as jint)
    })
}

// ---- waiting for space -------------------------------------------------------------------------

/// The JVM and a global reference to `TernNative`, kept by the first `openWriter` that waits for
/// space: runtime threads have no class loader of their own to find the plugin's classes with.
static JAVA: OnceLock<(JavaVM, GlobalRef)> = OnceLock::new();

/// A [`SpaceWait`] of `limit_ms` whose pauses call `TernNative.spaceWait(message)`.
fn space_wait(env: &mut JNIEnv, limit_ms: jlong) -> Outcome<SpaceWait> {
    if limit_ms <= 0 {
        return Ok(SpaceWait::default());
    }
    if JAVA.get().is_none() {
        let class = env.find_class(NATIVE_CLASS)?;
        let _ = JAVA.set((env.get_java_vm()?, env.new_global_ref(class)?));
    }
    Ok(SpaceWait {
        limit: Duration::from_millis(limit_ms as u64),
        on_wait: Some(Arc::new(|refusal: &tern_client::Error| tell_java_space_wait(refusal))),
    })
}

/// Calls `TernNative.spaceWait(refusal)` on this (runtime) thread. A failure is logged, never
/// raised: the push waits and retries either way.
fn tell_java_space_wait(refusal: &tern_client::Error) {
    let Some((vm, native)) = JAVA.get() else { return };
    let called = (|| -> jni::errors::Result<()> {
        let mut env = vm.attach_current_thread_as_daemon()?;
        // A frame frees the call's local references: this thread never returns to Java to do it.
        env.with_local_frame(4, |env| -> jni::errors::Result<()> {
            let message = env.new_string(refusal.to_string())?;
            let class = <&JClass>::from(native.as_obj());
            let result =
                env.call_static_method(class, "spaceWait", "(Ljava/lang/String;)V", &[JValue::Object(&message)]);
            if env.exception_check()? {
                env.exception_describe()?;
                env.exception_clear()?;
            }
            result.map(|_| ())
        })
    })();
    if let Err(e) = called {
        tracing::warn!("telling Java that a push waits for space failed: {e}");
    }
}

// ---- map writers ------------------------------------------------------------------------------

#[no_mangle]
pub extern "system" fn Java_io_tern_spark_TernNative_openWriter<'l>(
    mut env: JNIEnv<'l>,
    _: JClass<'l>,
    shuffle: jlong,
    map: jint,
    attempt: jint,
    buffer_bytes: jlong,
    batch_bytes: jint,
    pushes_in_flight: jint,
    space_wait_ms: jlong,
) -> jlong {
    entry(&mut env, |env| {
        // SAFETY: a live shuffle handle.
        let shuffle = unsafe { shared::<Shuffle>(shuffle)? };
        if map < 0 || buffer_bytes <= 0 || batch_bytes <= 0 || pushes_in_flight <= 0 {
            return Err(invalid(format!(
                "openWriter: map {map}, buffer {buffer_bytes}, batch {batch_bytes}, in flight {pushes_in_flight}"
            )));
        }
        let options = MapWriterOptions {
            buffer_bytes: buffer_bytes as usize,
            batch_bytes: batch_bytes as usize,
            pushes_in_flight: pushes_in_flight as usize,
        };
        let wait = space_wait(env, space_wait_ms)?;
        let writer = shuffle.writer_with(map as u32, attempt as u32, options).wait_for_space(wait);
        Ok(into_handle(Writer { writer: Some(writer) }))
    })
}

/// Appends `length` bytes at `offset` of the direct buffer `data` to `partition`'s output. One
/// call's bytes stay together in one batch unless they exceed the batch size.
#[no_mangle]
pub extern "system" fn Java_io_tern_spark_TernNative_write<'l>(
    mut env: JNIEnv<'l>,
    _: JClass<'l>,
    writer: jlong,
    partition: jint,
    data: JByteBuffer<'l>,
    offset: jint,
    length: jint,
) {
    entry(&mut env, |env| {
        // SAFETY: a live writer handle.
        let writer = unsafe { exclusive::<Writer>(writer)? };
        let writer = writer.writer.as_mut().ok_or_else(|| invalid("write after commit"))?;
        let address = env.get_direct_buffer_address(&data)?;
        let capacity = env.get_direct_buffer_capacity(&data)?;
        if partition < 0 || offset < 0 || length < 0 || offset as usize + length as usize > capacity {
            return Err(invalid(format!(
                "write: partition {partition}, bytes [{offset}, +{length}) of a {capacity}-byte buffer"
            )));
        }
        // SAFETY: the range lies inside the direct buffer, which Java keeps alive and unchanged
        // for the duration of this call (the write copies what it keeps).
        let bytes = unsafe { std::slice::from_raw_parts(address.add(offset as usize), length as usize) };
        runtime().block_on(writer.write(partition as u32, bytes))?;
        Ok(())
    })
}

/// Pushes what is buffered and commits. Returns the winning attempt in the low 32 bits and, in
/// bit 32, whether this attempt won (first commit wins).
#[no_mangle]
pub extern "system" fn Java_io_tern_spark_TernNative_commit<'l>(
    mut env: JNIEnv<'l>,
    _: JClass<'l>,
    writer: jlong,
) -> jlong {
    entry(&mut env, |_| {
        // SAFETY: a live writer handle.
        let writer = unsafe { exclusive::<Writer>(writer)? };
        let writer = writer.writer.take().ok_or_else(|| invalid("commit twice"))?;
        let outcome = runtime().block_on(writer.commit())?;
        Ok(((outcome.committed as jlong) << 32) | jlong::from(outcome.winning_attempt))
    })
}

/// Frees a writer; an uncommitted one is abandoned (its pushed bytes are never read).
#[no_mangle]
pub extern "system" fn Java_io_tern_spark_TernNative_closeWriter<'l>(_: JNIEnv<'l>, _: JClass<'l>, writer: jlong) {
    let _ = catch_unwind(|| {
        // Push tasks in flight belong to the runtime; dropping them needs its context.
        let _guard = runtime().enter();
        // SAFETY: a writer handle, closed once.
        unsafe { close::<Writer>(writer) }
    });
}

// ---- readers ----------------------------------------------------------------------------------

/// A reader of the committed batches of partitions x maps (half-open ranges). Fails with
/// `data-lost` at once if any of those maps has bytes on a lost server.
#[no_mangle]
pub extern "system" fn Java_io_tern_spark_TernNative_openReader<'l>(
    mut env: JNIEnv<'l>,
    _: JClass<'l>,
    shuffle: jlong,
    start_partition: jint,
    end_partition: jint,
    start_map: jint,
    end_map: jint,
) -> jlong {
    entry(&mut env, |_| {
        // SAFETY: a live shuffle handle.
        let shuffle = unsafe { shared::<Shuffle>(shuffle)? };
        let (partitions, maps) = (range(start_partition, end_partition)?, range(start_map, end_map)?);
        let reader = runtime().block_on(shuffle.reader(partitions, maps))?;
        Ok(into_handle(Reader { reader, current: None }))
    })
}

/// The committed maps the reader covers, as `[map index, attempt, map index, attempt, ...]`.
#[no_mangle]
pub extern "system" fn Java_io_tern_spark_TernNative_readerCommits<'l>(
    mut env: JNIEnv<'l>,
    _: JClass<'l>,
    reader: jlong,
) -> jlongArray {
    entry(&mut env, |env| {
        // SAFETY: a live reader handle.
        let reader = unsafe { exclusive::<Reader>(reader)? };
        let pairs: Vec<jlong> =
            reader.reader.outputs().iter().flat_map(|o| [jlong::from(o.map_index), jlong::from(o.attempt)]).collect();
        let array = env.new_long_array(pairs.len() as jint)?;
        env.set_long_array_region(&array, 0, &pairs)?;
        Ok(array.into_raw())
    })
}

/// The next batch as a direct ByteBuffer over native memory (valid until the next call on this
/// reader), with `meta[0]` = its partition and `meta[1]` = its map index; null at the end.
#[no_mangle]
pub extern "system" fn Java_io_tern_spark_TernNative_nextBatch<'l>(
    mut env: JNIEnv<'l>,
    _: JClass<'l>,
    reader: jlong,
    meta: JIntArray<'l>,
) -> jobject {
    entry(&mut env, |env| {
        // SAFETY: a live reader handle.
        let reader = unsafe { exclusive::<Reader>(reader)? };
        reader.current = None;
        let Some(batch) = runtime().block_on(reader.reader.next_batch())? else {
            return Ok(JObject::null().into_raw());
        };
        env.set_int_array_region(&meta, 0, &[batch.partition as jint, batch.map as jint])?;
        let data = reader.current.insert(batch.data);
        // SAFETY: the bytes live in `reader.current` until the next call or close, and Java
        // only reads through the buffer.
        let buffer = unsafe { env.new_direct_byte_buffer(data.as_ptr() as *mut u8, data.len())? };
        Ok(buffer.into_raw())
    })
}

#[no_mangle]
pub extern "system" fn Java_io_tern_spark_TernNative_closeReader<'l>(_: JNIEnv<'l>, _: JClass<'l>, reader: jlong) {
    let _ = catch_unwind(|| {
        let _guard = runtime().enter();
        // SAFETY: a reader handle, closed once.
        unsafe { close::<Reader>(reader) }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pem_of(dir: &std::path::Path) -> [String; 3] {
        ["ca.pem", "node.pem", "node.key"].map(|name| std::fs::read_to_string(dir.join(name)).unwrap())
    }

    /// The two sides of JNI name one ABI: the jar's `NativeLibrary.ABI` is this library's.
    #[test]
    fn the_jar_and_the_library_name_the_same_abi() {
        let java = include_str!("main/java/io/tern/spark/NativeLibrary.java");
        let declared = java
            .lines()
            .find_map(|line| line.trim().strip_prefix("static final int ABI = "))
            .and_then(|rest| rest.trim_end_matches(';').parse::<jint>().ok());
        assert_eq!(declared, Some(JNI_ABI), "NativeLibrary.ABI must equal JNI_ABI");
    }

    #[test]
    fn tls_material_comes_from_the_directory_or_all_three_pem_settings() {
        let dir = tempfile::tempdir().unwrap();
        tern_transport::tls::init(dir.path(), &tern_transport::tls::InitOptions::default()).unwrap();
        let path = dir.path().to_str().unwrap();
        let none = || [String::new(), String::new(), String::new()];
        assert!(tls_material("", none()).ok().unwrap().is_none());
        assert!(tls_material(path, none()).ok().unwrap().is_some());
        assert!(tls_material("", pem_of(dir.path())).ok().unwrap().is_some());

        let refused = |dir: &str, pem: [String; 3]| tls_material(dir, pem).expect_err("refused").message;
        assert!(refused(path, pem_of(dir.path())).contains("not both"));
        let [ca, cert, _] = pem_of(dir.path());
        assert!(refused("", [ca.clone(), cert, String::new()]).contains("give all three"));
        let [_, cert, key] = pem_of(dir.path());
        let message = refused("", ["not pem".into(), cert, key]);
        assert!(message.contains("spark.tern.tls.ca: not a PEM certificate"), "{message}");
        let [_, cert, _] = pem_of(dir.path());
        let other = tempfile::tempdir().unwrap();
        tern_transport::tls::init(other.path(), &tern_transport::tls::InitOptions::default()).unwrap();
        let [_, _, other_key] = pem_of(other.path());
        let message = refused("", [ca, cert, other_key]);
        assert!(message.contains("spark.tern.tls.secretKey does not go with spark.tern.tls.cert"), "{message}");
        assert!(refused("/nonexistent", none()).contains("spark.tern.tlsDir: no TLS material"));
    }
}

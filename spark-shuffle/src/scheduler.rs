//! Tern's scheduler over JNI, for the Java class `io.tern.spark.TernSchedulerNative`: what a Spark
//! driver running Tern's cluster manager calls to submit its application as a Tern job (an
//! elastic stage of `spark-executor` tasks per resource profile: "executors" for the default one,
//! submitted with the job; the others added when Spark first asks for them) and to scale them.
//! The same rules as the rest of the crate: opaque handles freed by `closeScheduler`, every call
//! under `entry` (errors thrown as `TernException`), calls blocking their Java thread on the
//! crate's runtime.
//!
//! Replies cross as text, one fact a line, so Java needs no generated protobuf classes:
//! `state <JobState> next <ended_next> queued <n> running <n>`, then `added <i> <i> ...`, then
//! one `ended <task index> <outcome> <message>` line per ended task (message on one line).

use jni::objects::{JClass, JIntArray, JObjectArray, JString};
use jni::sys::{jboolean, jint, jlong, jstring};
use jni::JNIEnv;
use tern_proto::sched as pb;
use tern_scheduler_api::SchedulerClient;

use super::{close, entry, into_handle, invalid, runtime, shared, string, Outcome};

/// Most operator parameters or environment variables a submission carries.
const MAX_PAIRS: usize = 256;

/// A `String[]` of keys and one of values, as pairs.
fn pairs(env: &mut JNIEnv, keys: &JObjectArray, values: &JObjectArray) -> Outcome<Vec<(String, String)>> {
    let n = env.get_array_length(keys)? as usize;
    if n != env.get_array_length(values)? as usize || n > MAX_PAIRS {
        return Err(invalid(format!("keys and values must be as many, at most {MAX_PAIRS}")));
    }
    let mut out = Vec::with_capacity(n);
    for i in 0..n as i32 {
        let key = JString::from(env.get_object_array_element(keys, i)?);
        let value = JString::from(env.get_object_array_element(values, i)?);
        out.push((string(env, &key)?, string(env, &value)?));
    }
    Ok(out)
}

#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub extern "system" fn Java_io_tern_spark_TernSchedulerNative_connect<'l>(
    mut env: JNIEnv<'l>,
    _: JClass<'l>,
    addr: JString<'l>,
    tls_dir: JString<'l>,
    ca_pem: JString<'l>,
    cert_pem: JString<'l>,
    key_pem: JString<'l>,
    credential_file: JString<'l>,
) -> jlong {
    entry(&mut env, |env| {
        let addr = string(env, &addr)?;
        let tls = crate::tls_settings(env, &tls_dir, [&ca_pem, &cert_pem, &key_pem])?;
        // The driver submits into its tenant's queue with its tenant's credential.
        let credential = crate::credential_setting(env, &credential_file)?;
        let client =
            runtime().block_on(SchedulerClient::connect_with_tls(&addr, tls.as_ref(), credential.as_deref()))?;
        Ok(into_handle(client))
    })
}

#[no_mangle]
pub extern "system" fn Java_io_tern_spark_TernSchedulerNative_closeScheduler<'l>(
    _: JNIEnv<'l>,
    _: JClass<'l>,
    client: jlong,
) {
    // SAFETY: the handle came from `connect` and Java closes it once, after its last call.
    let _ = std::panic::catch_unwind(|| unsafe { close::<SchedulerClient>(client) });
}

/// One elastic stage of `spark-executor` tasks, each needing `cpu_milli`, `memory_bytes` and
/// `gpu_milli`; a gang of `min_available` when above 0.
#[allow(clippy::too_many_arguments)]
fn executor_stage(
    name: &str,
    cpu_milli: jlong,
    memory_bytes: jlong,
    gpu_milli: jlong,
    tasks: jint,
    min_available: jint,
    lease_ms: jlong,
    params: Vec<(String, String)>,
    env: Vec<(String, String)>,
) -> Outcome<pb::StageSpec> {
    if cpu_milli <= 0 || memory_bytes <= 0 || gpu_milli < 0 || tasks < 0 || min_available < 0 || lease_ms < 0 {
        return Err(invalid("an executor needs CPUs and memory above 0; counts must be >= 0"));
    }
    Ok(pb::StageSpec {
        name: name.into(),
        operator: Some(pb::Operator {
            name: "spark-executor".into(),
            params: params.into_iter().collect(),
            argv: Vec::new(),
            env: env.into_iter().collect(),
        }),
        tasks: tasks as u32,
        needs: Some(pb::Resources {
            cpu_milli: cpu_milli as u64,
            memory_bytes: memory_bytes as u64,
            gpu_milli: gpu_milli as u64,
        }),
        gang: min_available > 0,
        min_available: min_available as u32,
        elastic: true,
        lease_ms: lease_ms as u64,
        ..Default::default()
    })
}

/// Submits the application: one job, one elastic stage "executors" (the default resource
/// profile's) of `initial` tasks, each needing `cpu_milli`, `memory_bytes` and `gpu_milli`; a gang
/// of `min_available` when above 0; cancelled by the scheduler when no `scale` call comes for
/// `lease_ms`. Returns three lines: the job id, its Tern job id and that Tern job's token.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub extern "system" fn Java_io_tern_spark_TernSchedulerNative_submit<'l>(
    mut env: JNIEnv<'l>,
    _: JClass<'l>,
    client: jlong,
    name: JString<'l>,
    queue: JString<'l>,
    priority: jint,
    cpu_milli: jlong,
    memory_bytes: jlong,
    gpu_milli: jlong,
    initial: jint,
    min_available: jint,
    lease_ms: jlong,
    param_keys: JObjectArray<'l>,
    param_values: JObjectArray<'l>,
    env_keys: JObjectArray<'l>,
    env_values: JObjectArray<'l>,
) -> jstring {
    entry(&mut env, |env| {
        // SAFETY: a live scheduler handle; SchedulerClient is Sync (see `shared`).
        let client = unsafe { shared::<SchedulerClient>(client)? }.clone();
        let params = pairs(env, &param_keys, &param_values)?;
        let vars = pairs(env, &env_keys, &env_values)?;
        let stage = executor_stage(
            "executors",
            cpu_milli,
            memory_bytes,
            gpu_milli,
            initial,
            min_available,
            lease_ms,
            params,
            vars,
        )?;
        let spec = pb::JobSpec {
            name: string(env, &name)?,
            queue: string(env, &queue)?,
            priority,
            stages: vec![stage],
            ..Default::default()
        };
        let submitted = runtime().block_on(client.submit_with_tern_job(spec))?;
        let reply = format!("{}\n{}\n{}", submitted.job_id, submitted.tern_job_id, submitted.tern_job_token);
        Ok(env.new_string(reply)?.into_raw())
    })
}

/// Adds the elastic stage `stage` (another resource profile's executors, each needing
/// `cpu_milli`, `memory_bytes` and `gpu_milli`) to the application's job, with no tasks yet
/// (ScaleStage with `create`; a stage that exists already is left as it is, so a retry is safe).
/// The reply as the module says.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub extern "system" fn Java_io_tern_spark_TernSchedulerNative_createStage<'l>(
    mut env: JNIEnv<'l>,
    _: JClass<'l>,
    client: jlong,
    job_id: JString<'l>,
    stage: JString<'l>,
    cpu_milli: jlong,
    memory_bytes: jlong,
    gpu_milli: jlong,
    lease_ms: jlong,
    param_keys: JObjectArray<'l>,
    param_values: JObjectArray<'l>,
    env_keys: JObjectArray<'l>,
    env_values: JObjectArray<'l>,
) -> jstring {
    entry(&mut env, |env| {
        // SAFETY: a live scheduler handle (see `shared`).
        let client = unsafe { shared::<SchedulerClient>(client)? }.clone();
        let stage = string(env, &stage)?;
        let params = pairs(env, &param_keys, &param_values)?;
        let vars = pairs(env, &env_keys, &env_values)?;
        let create = executor_stage(&stage, cpu_milli, memory_bytes, gpu_milli, 0, 0, lease_ms, params, vars)?;
        let request =
            pb::ScaleStageRequest { job_id: string(env, &job_id)?, stage, create: Some(create), ..Default::default() };
        let reply = runtime().block_on(client.scale_stage(request))?;
        Ok(env.new_string(reply_text(&reply))?.into_raw())
    })
}

/// Scales one of the application's stages; the reply as the module says.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub extern "system" fn Java_io_tern_spark_TernSchedulerNative_scale<'l>(
    mut env: JNIEnv<'l>,
    _: JClass<'l>,
    client: jlong,
    job_id: JString<'l>,
    stage: JString<'l>,
    add: jint,
    cancel: JIntArray<'l>,
    finish: jboolean,
    ended_from: jint,
) -> jstring {
    entry(&mut env, |env| {
        // SAFETY: a live scheduler handle (see `shared`).
        let client = unsafe { shared::<SchedulerClient>(client)? }.clone();
        if add < 0 || ended_from < 0 {
            return Err(invalid("add and ended_from must be >= 0"));
        }
        let mut indexes = vec![0; env.get_array_length(&cancel)? as usize];
        env.get_int_array_region(&cancel, 0, &mut indexes)?;
        if indexes.iter().any(|&i| i < 0) {
            return Err(invalid("a negative task index to cancel"));
        }
        let request = pb::ScaleStageRequest {
            job_id: string(env, &job_id)?,
            stage: string(env, &stage)?,
            add: add as u32,
            cancel: indexes.into_iter().map(|i| i as u32).collect(),
            finish: finish != 0,
            ended_from: ended_from as u32,
            create: None,
        };
        let reply = runtime().block_on(client.scale_stage(request))?;
        Ok(env.new_string(reply_text(&reply))?.into_raw())
    })
}

/// Why the application's executor tasks cannot start (the stage's `blocked` in the job's status:
/// no live executor fits one, or the live executors cannot hold its gang), "" when they can.
#[no_mangle]
pub extern "system" fn Java_io_tern_spark_TernSchedulerNative_blocked<'l>(
    mut env: JNIEnv<'l>,
    _: JClass<'l>,
    client: jlong,
    job_id: JString<'l>,
) -> jstring {
    entry(&mut env, |env| {
        // SAFETY: a live scheduler handle (see `shared`).
        let client = unsafe { shared::<SchedulerClient>(client)? }.clone();
        let job_id = string(env, &job_id)?;
        let status = runtime().block_on(client.job(&job_id))?;
        let blocked = status.stages.first().map(|s| s.blocked.replace(['\n', '\r'], " ")).unwrap_or_default();
        Ok(env.new_string(blocked)?.into_raw())
    })
}

fn reply_text(reply: &pb::ScaleStageResponse) -> String {
    let mut text = format!(
        "state {} next {} queued {} running {}\nadded",
        reply.state().as_str_name().trim_start_matches("JOB_STATE_"),
        reply.ended_next,
        reply.queued,
        reply.running
    );
    for i in &reply.added {
        text.push_str(&format!(" {i}"));
    }
    for end in &reply.ended {
        let message = end.message.replace(['\n', '\r'], " ");
        let outcome = end.outcome().as_str_name().trim_start_matches("TASK_OUTCOME_");
        text.push_str(&format!("\nended {} {outcome} {message}", end.task_index));
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replies_are_one_fact_a_line() {
        let reply = pb::ScaleStageResponse {
            added: vec![4, 5],
            ended: vec![pb::ElasticTaskEnd {
                task_index: 2,
                outcome: pb::TaskOutcome::Oom as i32,
                message: "killed\nby SIGKILL".into(),
            }],
            ended_next: 3,
            state: pb::JobState::Running as i32,
            queued: 2,
            running: 1,
        };
        assert_eq!(
            reply_text(&reply),
            "state RUNNING next 3 queued 2 running 1\nadded 4 5\nended 2 OOM killed by SIGKILL"
        );
    }
}

"""Tern's Spark shuffle plugin on real Spark (pyspark 3.5.3 or 4.3.0, local-cluster[2,1,1024]).

Runs every case once on Spark's built-in shuffle and once on Tern (one SparkContext each) and
fails if any result differs, if AQE did not split the skewed join, or if the TeraSort output does
not validate with the input's checksum. Then, on Tern: unregistered shuffles and a stopped
application leave no blocks in Tern; a storage server lost (its link cut) costs exactly one resubmission of
the map stage, which reruns exactly the maps Tern lost; and a second driver (this script with
--child) runs with dynamic allocation and no external shuffle service (its executors are
released between two jobs reading one shuffle) and is then killed with SIGKILL: its data must be
freed when its job lease lapses.

With TERN_SPARK_MASTER (`local-cluster-tern://HOST:PORT`, Tern's scheduler of a `tern up` cluster) the
Tern side runs on Tern's scheduler instead of local-cluster: its executors are Tern tasks, which
the suite checks through `tern job status`, and the built-in side runs in local[2]; it also SIGKILLs one executor JVM mid-stage (the job
must still be right, the executor replaced). The dynamic-allocation child then scales its
executors (Tern tasks) up, down to none and up again, and reads its shuffle once more in a stage
with a resource profile of its own (stage-level scheduling: 2-core, one-GPU executors of that
profile, which Tern runs as a stage of their own in the application's job; needs Tern executors
of 2 CPUs with GPUs). The storage-server fault needs
TERN_STORAGE_FAULT; without it that case is not run, and the suite says so.

Environment: TERN_METADATA (host:port of a running cluster), TERN_SPARK_JAR (the jar for the
running Spark's line), TERN_BIN (the tern binary), TERN_WORK (a scratch directory),
TERN_CLUSTER_SECRET (the cluster secret's file: the child, a job of its own tenant, is issued that
tenant's credential with it, spark.tern.credentialFile); optionally
TERN_SPARK_SHUFFLE_MANAGER (the running Spark's manager class: Spark 4.3's is
io.tern.spark.TernBlockingShuffleManager; default io.tern.spark.TernShuffleManager), TERN_STORAGE_FAULT (a shell command that
takes one storage server of that cluster away: the multi-host test cuts its link, so its packets
vanish), TERN_SPARK_MASTER, and TERN_TLS_DIR where the cluster speaks TLS: then the main
application gives the material as PEM text (spark.tern.tls.*) and moves blocks over QUIC, and the
second driver names the directory (spark.tern.tlsDir) and takes the default transport.
TERN_SPARK_SMOKE=1 leaves out the JVM cases, the TeraSort and the child's stage of its own resource
profile (the smoke run of the Spark lines tested less often: their shuffles, AQE's skew join, a
killed executor, dynamic allocation and Tern's master stay; the profile's stage starts two more
executor JVMs, about 20 s a line, through the same backend code every 4.x line shares, which the
4.3 suite runs).
"""

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from operator import add

import pyspark
from pyspark import SparkConf, SparkContext, TaskContext
from pyspark.sql import SparkSession, Window
from pyspark.sql import functions as F

METADATA = os.environ["TERN_METADATA"]
JAR = os.environ["TERN_SPARK_JAR"]
TERN = os.environ["TERN_BIN"]
STORAGE_FAULT = os.environ.get("TERN_STORAGE_FAULT", "")
WORK = os.environ["TERN_WORK"]
MASTER = os.environ.get("TERN_SPARK_MASTER", "")
TERASORT_BYTES = int(os.environ.get("TERN_TERASORT_BYTES", str(24 << 20)))
TLS_DIR = os.environ.get("TERN_TLS_DIR", "")
SMOKE = os.environ.get("TERN_SPARK_SMOKE", "") == "1"
MANAGER = os.environ.get("TERN_SPARK_SHUFFLE_MANAGER", "io.tern.spark.TernShuffleManager")


def tls_conf(as_text):
    """How an application reaches a TLS cluster: PEM text in its conf, or the directory."""
    if not TLS_DIR:
        return []
    if not as_text:
        return [("spark.tern.tlsDir", TLS_DIR)]
    pem = lambda name: open(os.path.join(TLS_DIR, name)).read()
    return [("spark.tern.tls.ca", pem("ca.pem")), ("spark.tern.tls.cert", pem("node.pem")),
            ("spark.tern.tls.secretKey", pem("node.key")), ("spark.tern.transport", "quic")]


def master(tern):
    """Tern's side on Tern's scheduler when TERN_SPARK_MASTER says so; the built-in side then runs
    in local[2] (no executor JVMs to start: the reference results cost less CI time)."""
    if not MASTER:
        return "local-cluster[2,1,1024]"
    return MASTER if tern else "local[2]"


def spark(tern, extra=()):
    conf = (
        SparkConf()
        .setMaster(master(tern))
        .setAppName("tern-suite-" + ("tern" if tern else "builtin"))
        .set("spark.driver.extraClassPath", JAR)
        .set("spark.executor.extraClassPath", JAR)
        .set("spark.executor.memory", "700m")
        .set("spark.ui.enabled", "false")
        .set("spark.sql.shuffle.partitions", "8")
        .set("spark.sql.autoBroadcastJoinThreshold", "-1")
        .set("spark.sql.adaptive.enabled", "true")
        .set("spark.sql.adaptive.localShuffleReader.enabled", "false")
        .set("spark.sql.adaptive.skewJoin.enabled", "true")
        .set("spark.sql.adaptive.skewJoin.skewedPartitionThresholdInBytes", "1k")
        .set("spark.sql.adaptive.skewJoin.skewedPartitionFactor", "1")
        .set("spark.sql.adaptive.advisoryPartitionSizeInBytes", "1k")
    )
    if tern:
        conf = (
            conf.set("spark.shuffle.manager", MANAGER)
            .set("spark.shuffle.sort.io.plugin.class", "io.tern.spark.TernShuffleDataIO")
            .set("spark.tern.metadata", METADATA)
        )
    for key, value in extra:
        conf = conf.set(key, value)
    sc = SparkContext(conf=conf)
    manager = jvm_cases(sc).shuffleManagerClass()
    expected = MANAGER if tern else "org.apache.spark.shuffle.sort.SortShuffleManager"
    assert manager == expected, f"shuffle manager is {manager}, wanted {expected}"
    return sc, SparkSession(sc)


def rdd_cases(sc):
    nums = sc.parallelize(range(30000), 4)
    a = sc.parallelize([(i % 50, i) for i in range(3000)], 3)
    b = sc.parallelize([(i % 70, -i) for i in range(2000)], 2)
    keys = list(range(20000))
    keys = keys[7::13] + [k for k in keys if (k - 7) % 13 != 0]
    return {
        "rdd.reduceByKey": sorted(nums.map(lambda x: (x % 97, x)).reduceByKey(add, 5).collect()),
        "rdd.groupByKey": sorted(
            nums.map(lambda x: (x % 41, x)).groupByKey(3).mapValues(lambda v: sorted(v)).collect()
        ),
        # Order is the result: no sorting afterwards.
        "rdd.sortByKey": sc.parallelize([(k, str(k)) for k in keys], 4).sortByKey(numPartitions=5).collect(),
        "rdd.join": sorted(a.join(b, 4).collect()),
        "rdd.cogroup": sorted(
            (k, (sorted(x), sorted(y))) for k, (x, y) in a.cogroup(b, 3).collect()
        ),
    }


def jvm_cases(sc):
    """The jar's io.tern.spark.tools.JvmCases: also how the suite reaches the driver's SparkEnv,
    whose own methods Py4J cannot call on Spark 4.3 (see JvmCases.shuffleManager)."""
    return sc._jvm.io.tern.spark.tools.JvmCases


def run_jvm_cases(sc):
    cases = jvm_cases(sc)
    return {
        "jvm.reduceByKey(map-side combine)": cases.reduceByKey(sc._jsc),
        "jvm.groupByKey": cases.groupByKey(sc._jsc),
        "jvm.sortByKey(ExternalSorter)": cases.sortByKey(sc._jsc),
        "jvm.aggregateByKey": cases.aggregateByKey(sc._jsc),
    }


def sql_cases(session):
    facts = session.range(0, 20000).select(
        # Key 0 holds half the rows: AQE sees a skewed partition and splits it by map ranges.
        F.when(F.col("id") % 2 == 0, F.lit(0)).otherwise(F.col("id") % 100).alias("k"),
        F.col("id").alias("v"),
    )
    dims = session.range(0, 100).select(F.col("id").alias("k"), (F.col("id") * 10).alias("w"))
    joined = facts.join(dims, "k")
    rows = sorted(tuple(r) for r in joined.collect())
    plan = joined._jdf.queryExecution().executedPlan().toString()
    assert "skew=true" in plan, "AQE did not split the skewed join:\n" + plan
    window = Window.partitionBy("k").orderBy(F.col("v").desc())
    return {
        "sql.groupBy.agg": sorted(
            tuple(r) for r in facts.groupBy("k").agg(F.count("*"), F.sum("v"), F.max("v")).collect()
        ),
        "sql.join(skew split)": rows,
        "sql.orderBy": [tuple(r) for r in facts.orderBy(F.col("v").desc()).limit(3000).collect()],
        "sql.orderBy(full)": [r[0] for r in facts.orderBy("k", "v").select("v").collect()],
        "sql.window": sorted(
            tuple(r) for r in facts.withColumn("rank", F.row_number().over(window)).where("rank <= 3").collect()
        ),
    }


def spark_version(sc):
    return tuple(int(x) for x in sc.version.split("-")[0].split(".")[:2])


def shuffle_checksums(sc, session):
    """Spark 4.1 on: the order-independent checksum each map of one SQL shuffle reported
    (MapStatus.checksumValue; on by default from 4.2, switched on here for 4.1). The driver
    compares a rerun map's with its first run's to catch nondeterministic recomputation, so Tern's
    must be the value Spark's own writer reports for the same records: the suite compares them with
    the built-in shuffle's, map by map. None before 4.1."""
    if spark_version(sc) < (4, 1):
        return None
    session.conf.set("spark.sql.shuffle.orderIndependentChecksum.enabled", "true")
    rows = session.range(0, 20000, 1, 4).groupBy((F.col("id") % 37).alias("k")).count().collect()
    assert len(rows) == 37, rows
    # The query's shuffle is the driver's newest.
    checksums = list(jvm_cases(sc).newestShuffleChecksums())
    assert len(checksums) == 4 and all(checksums), f"maps reported checksums {checksums}"
    return checksums


def checksum_cases(sc, session):
    checksums = shuffle_checksums(sc, session)
    return {} if checksums is None else {"sql.shuffle checksums (Spark 4.1+)": checksums}


def teragen():
    data = os.path.join(WORK, "teragen")
    out = subprocess.run(
        [TERN, "teragen", "--local", "--size", str(TERASORT_BYTES), "--out", data, "--parts", "3"],
        check=True, capture_output=True, text=True,
    ).stdout
    checksum = next(line.split()[1] for line in out.splitlines() if line.startswith("Checksum:"))
    return data, checksum


def terasort(sc, data, name):
    out = os.path.join(WORK, "terasort-" + name)
    report = json.loads(sc._jvm.io.tern.spark.tools.TeraSort.run(sc._jsc, data, out, 5))
    valid = subprocess.run(
        [TERN, "teravalidate", "--local", "--json", out], check=True, capture_output=True, text=True
    ).stdout
    return report, json.loads(valid)


def tern_status():
    return json.loads(subprocess.run([TERN, "status", "--json"], check=True, capture_output=True, text=True).stdout)


def held_bytes():
    """Bytes the live storage servers hold, as they last reported to the metadata server."""
    return sum(t["used_bytes"] for s in tern_status()["servers"] if s["alive"] for t in s["tiers"])


def wait_for(what, check, timeout):
    deadline = time.time() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.time() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.2)


def stage_log(sc):
    log = sc._jvm.io.tern.spark.tools.StageLog()
    sc._jsc.sc().addSparkListener(log)
    return log


def events(sc, log):
    sc._jsc.sc().listenerBus().waitUntilEmpty()
    return json.loads(log.json())


def frees_unregistered_shuffles(sc):
    """Spark's shuffle cleanup (unregisterShuffle on the driver) frees every block in Tern."""
    manager = jvm_cases(sc).shuffleManager()
    shuffles = list(manager.registeredShuffles())
    assert shuffles, "no Tern shuffles registered after the cases ran"
    assert held_bytes() > 0, "Tern holds no bytes while the shuffles are registered"
    cleaner = sc._jsc.sc().cleaner().get()
    for shuffle in shuffles:
        cleaner.doCleanupShuffle(shuffle, True)
    assert list(manager.registeredShuffles()) == [], "the driver still holds shuffles after cleanup"
    wait_for("Tern to free the unregistered shuffles' blocks", lambda: held_bytes() == 0, 15)
    return len(shuffles)


def scheduler_job(job_id, tenant=None):
    """`tern job status --json` of the application's job on Tern's scheduler, as a client of its
    queue's tenant (`tenant`, or the default one)."""
    scheduler = MASTER.split("://", 1)[1]
    as_tenant = ["--as", tenant_credential(tenant)] if tenant else []
    out = subprocess.run([TERN, "job", "status", job_id, "--json", "--scheduler", scheduler] + as_tenant,
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def executor_pids(app_id):
    """Executor JVMs of the application, from /proc."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
        except OSError:
            continue
        if b"org.apache.spark.executor.CoarseGrainedExecutorBackend" in args and app_id.encode() in args:
            pids.append((int(pid), args[args.index(b"--executor-id") + 1].decode()))
    return pids


def survive_killed_executor(sc):
    """SIGKILLs one executor JVM while a stage runs on it: the result is still right, Tern's
    scheduler saw the task die, and the backend asks for a replacement."""
    jsc = sc._jsc.sc()
    app = jsc.applicationId()
    executors = lambda: len(jsc.statusTracker().getExecutorInfos()) - 1
    wait_for("two executors", lambda: executors() == 2, 60)
    pids = executor_pids(app)
    assert len(pids) == 2, f"expected 2 executor JVMs of {app}, found {pids}"
    rdd = (sc.parallelize(range(40000), 8)
           .mapPartitions(lambda it: (time.sleep(1.0), list(it))[1])
           .map(lambda x: (x % 31, x)).reduceByKey(add, 4))
    expected = sorted((k, sum(range(k, 40000, 31))) for k in range(31))
    result = {}
    worker = threading.Thread(target=lambda: result.update(rows=sorted(rdd.collect())))
    worker.start()
    time.sleep(2.5)
    pid, executor = pids[0]
    os.kill(pid, signal.SIGKILL)
    worker.join(120)
    assert not worker.is_alive(), "the job did not finish after an executor was killed"
    assert result.get("rows") == expected, "the job's result is wrong after an executor was killed"
    wait_for("the killed executor to be replaced", lambda: executors() == 2 and
             executor not in {e for _, e in executor_pids(app)}, 60)
    return executor


def survive_lost_server(sc):
    """Takes a storage server away (TERN_STORAGE_FAULT) between a shuffle's map and reduce stages:
    the job still returns the right result, with one resubmission of the map stage that reruns
    exactly the lost maps."""
    n, maps = 60000, 6
    # Map i's keys are all = i (mod 6), so all its records go to reduce partition i (PySpark hashes
    # an int to itself): a killed server loses only the maps whose partition it held.
    rdd = (
        sc.parallelize(range(n), maps)
        .mapPartitionsWithIndex(lambda i, it: ((i + maps * (x % 7), x) for x in it))
        .reduceByKey(add, maps)
    )
    log = stage_log(sc)
    first = sorted(rdd.collect())
    assert len(first) == maps * 7 and sum(v for _, v in first) == sum(range(n)), "shuffle before the kill is wrong"
    shuffles = {s[2] for s in events(sc, log)["stages"] if s[2] >= 0}
    assert len(shuffles) == 1, f"expected one shuffle, saw {shuffles}"
    shuffle = shuffles.pop()
    manager = jvm_cases(sc).shuffleManager()
    subprocess.run(STORAGE_FAULT, shell=True, check=True)
    # The metadata server declares the server dead after its server timeout.
    lost = sorted(wait_for("Tern to report lost maps", lambda: list(manager.lostMaps(shuffle)), 20))
    log.clear()
    second = sorted(rdd.collect())
    assert second == first, "shuffle after losing a storage server is wrong"
    seen = events(sc, log)
    map_attempts = [s for s in seen["stages"] if s[2] == shuffle]
    assert len(map_attempts) == 1, f"the map stage ran {len(map_attempts)} more times, wanted 1: {seen}"
    map_stage, attempt = map_attempts[0][0], map_attempts[0][1]
    rerun = sorted(t[2] for t in seen["tasks"] if t[0] == map_stage and t[1] == attempt and t[3] == 1)
    assert rerun == lost, f"reran maps {rerun}, Tern lost maps {lost}"
    result_attempts = {(s[0], s[1]) for s in seen["stages"] if s[2] < 0}
    assert len(result_attempts) == 2, f"the reduce stage ran {len(result_attempts)} times, wanted 2: {seen}"
    return lost


CHILD_LEASE_S = 4
CHILD_TENANT = "spark-child"
# The child's one shuffle: its partitions, each a segment on two servers (spark.tern.copies=2).
CHILD_PARTITIONS = 4


def tenant_credential(tenant):
    """A credential file of a client of `tenant`, issued with the cluster secret (TERN_CLUSTER_SECRET)
    as an operator would: a job of that tenant needs it."""
    secret = os.environ.get("TERN_CLUSTER_SECRET", "")
    assert secret, "TERN_CLUSTER_SECRET (the cluster secret's file) is required: the child acts for its own tenant"
    path = os.path.join(WORK, f"credential-{tenant}")
    if not os.path.exists(path):
        # Its report is not the child's: the child's stdout carries only its JSON lines.
        made = subprocess.run([TERN, "cert", "credential", "--secret", secret, "--role", "client", "--tenant", tenant,
                               "--out", path], capture_output=True, text=True)
        assert made.returncode == 0, f"tern cert credential failed: {made.stderr}"
    return path


def child():
    """A second driver: dynamic allocation without an external shuffle service, then it waits to
    be killed (the parent kills its JVM with SIGKILL, so no shutdown hook ends its Tern job)."""
    sc, _ = spark(True, [
        ("spark.dynamicAllocation.enabled", "true"),
        ("spark.dynamicAllocation.shuffleTracking.enabled", "false"),
        ("spark.shuffle.service.enabled", "false"),
        ("spark.dynamicAllocation.executorIdleTimeout", "1s"),
        ("spark.dynamicAllocation.schedulerBacklogTimeout", "1s"),
        ("spark.dynamicAllocation.minExecutors", "0"),
        ("spark.dynamicAllocation.initialExecutors", "2"),
        ("spark.dynamicAllocation.maxExecutors", "2"),
        ("spark.tern.jobLease", f"{CHILD_LEASE_S}s"),
        ("spark.tern.tenant", CHILD_TENANT),
        ("spark.tern.credentialFile", tenant_credential(CHILD_TENANT)),
        ("spark.tern.copies", "2"),
    ] + tls_conf(as_text=False))
    jsc = sc._jsc.sc()
    executors = lambda: len(jsc.statusTracker().getExecutorInfos()) - 1  # less the driver
    rdd = sc.parallelize(range(40000), 4).map(lambda x: (x % 53, x)).reduceByKey(add, CHILD_PARTITIONS)
    expected = sorted((k, sum(range(k, 40000, 53))) for k in range(53))
    log = stage_log(sc)
    assert sorted(rdd.collect()) == expected, "dynamic allocation: first job is wrong"
    first = sorted({t[4] for t in events(sc, log)["tasks"]})
    wait_for("dynamic allocation to release every executor", lambda: executors() == 0, 60)
    log.clear()
    assert sorted(rdd.collect()) == expected, "dynamic allocation: reading the shuffle on new executors is wrong"
    seen = events(sc, log)
    second = sorted({t[4] for t in seen["tasks"]})
    assert not set(first) & set(second), f"the second job ran on the first job's executors: {first}, {second}"
    assert all(s[2] < 0 for s in seen["stages"]), f"map outputs were recomputed after executors left: {seen}"
    pid = sc._jvm.java.lang.ProcessHandle.current().pid()
    job = jvm_cases(sc).shuffleManager().ternJobId()
    app_job = jsc.schedulerBackend().ternJobId() if MASTER else None
    profiled = stage_level_scheduling(sc, rdd, expected, log, app_job) if MASTER and not SMOKE else None
    print(json.dumps({"pid": pid, "job": job, "app_job": app_job, "first_executors": first,
                      "second_executors": second, "profiled": profiled}), flush=True)
    time.sleep(600)


def task_resource_profile(sc):
    """Without dynamic allocation, a stage with a TaskResourceProfile (task resources only) is
    accepted under Tern's master and runs on the default profile's executors."""
    from pyspark.resource import ResourceProfileBuilder, TaskResourceRequests
    rp = ResourceProfileBuilder().require(TaskResourceRequests().cpus(1)).build
    log = stage_log(sc)
    out = sc.parallelize(range(1000), 4).map(lambda x: x * 2).withResources(rp).collect()
    assert out == [x * 2 for x in range(1000)], "the TaskResourceProfile's stage is wrong"
    ran_on = sorted({t[4] for t in events(sc, log)["tasks"]})
    assert ran_on and all(int(e) < 1_000_000 for e in ran_on), f"it ran on executors {ran_on}, not the default's"
    return ran_on


# Stage-level scheduling: executors of 2 cores, 512 MiB heap (+ 384 MiB overhead) and one GPU; 2 CPUs
# and the GPU a task.
PROFILE_CORES, PROFILE_HEAP_MIB = 2, 512


def stage_level_scheduling(sc, rdd, expected, log, app_job):
    """A stage with a resource profile of its own reads the child's shuffle (its map stage is not
    run again): its tasks see the profile's CPUs in TaskContext.cpus() and one GPU in
    TaskContext.resources(), and ran only on executors of that profile with its cores (ids
    profile * 1,000,000 + n), which Tern's scheduler ran as the application job's stage of that
    profile with that profile's resources (its GPU granted: the pool's executors offer GPUs from
    a discovery script)."""
    from pyspark.resource import ExecutorResourceRequests, ResourceProfileBuilder, TaskResourceRequests
    rp = (ResourceProfileBuilder()
          .require(ExecutorResourceRequests().cores(PROFILE_CORES).memory(f"{PROFILE_HEAP_MIB}m").resource("gpu", 1))
          .require(TaskResourceRequests().cpus(PROFILE_CORES).resource("gpu", 1)).build)
    log.clear()
    started = time.time()
    probe = lambda it: [(TaskContext.get().cpus(), list(TaskContext.get().resources()["gpu"].addresses), list(it))]
    out = rdd.mapPartitions(probe).withResources(rp).collect()
    assert sorted(r for _, _, part in out for r in part) == expected, \
        "the resource profile's stage read the shuffle wrong"
    cpus = {c for c, _, _ in out}
    assert cpus == {PROFILE_CORES}, f"the profile's tasks saw TaskContext.cpus() {cpus}, wanted {PROFILE_CORES}"
    gpus = [g for _, g, _ in out]
    assert all(len(g) == 1 and g[0] in ("0", "1") for g in gpus), f"the profile's tasks saw GPUs {gpus}, wanted one"
    seen = events(sc, log)
    ran_on = sorted({t[4] for t in seen["tasks"]})
    added = {e[0]: (e[1], e[2]) for e in seen["executors"]}
    for executor in ran_on:
        assert added.get(executor) == (rp.id, PROFILE_CORES) and int(executor) // 1_000_000 == rp.id, \
            f"a task of profile {rp.id} ran on executor {executor}: {added.get(executor)} (profile, cores)"
    name = f"executors-rp{rp.id}"
    stages = {st["name"]: st for st in scheduler_job(app_job, CHILD_TENANT)["stages"]}
    want = {"cpus": float(PROFILE_CORES), "memory_bytes": (PROFILE_HEAP_MIB + 384) << 20, "gpus": 1.0}
    assert name in stages and stages[name]["needs"] == want and stages[name]["attempts"] >= len(ran_on), \
        f"Tern's stage {name} for profile {rp.id} (wanted needs {want}): {stages}"
    return {"profile": rp.id, "executors": ran_on, "stage": name, "needs": want,
            "seconds": round(time.time() - started, 1)}


def dynamic_allocation_and_crashed_driver():
    log_path = os.path.join(WORK, "child-driver.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child"],
                                stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        ready_in_time, _, _ = select.select([proc.stdout], [], [], 240)
        line = proc.stdout.readline() if ready_in_time else ""
        if not line:
            proc.kill()
            with open(log_path) as log:
                raise AssertionError("the child driver failed or hung:\n" + log.read()[-6000:])
        ready = json.loads(line)
        status = tern_status()
        jobs = {j["job_id"]: j for j in status["jobs"]}
        assert ready["job"] in jobs and held_bytes() > 0, f"the child's job {ready['job']} holds no data: {jobs}"
        tenant = jobs[ready["job"]]["tenant"]
        assert tenant == CHILD_TENANT, f"the child's job counts against tenant {tenant!r}, not spark.tern.tenant"
        segments = sum(s["segments"] for s in status["servers"] if s["alive"])
        assert segments == 2 * CHILD_PARTITIONS, f"{segments} segments for {CHILD_PARTITIONS} partitions x 2 copies"
        os.kill(ready["pid"], signal.SIGKILL)
        killed = time.time()
        jobs = {j["job_id"] for j in tern_status()["jobs"]}
        assert ready["job"] in jobs, "the crashed driver's job ended before its lease lapsed"
        wait_for("the crashed driver's job to lapse",
                 lambda: ready["job"] not in {j["job_id"] for j in tern_status()["jobs"]}, CHILD_LEASE_S + 15)
        wait_for("the crashed driver's bytes to be freed", lambda: held_bytes() == 0, 15)
        lapsed = time.time() - killed
        if ready["app_job"]:
            wait_for("the crashed driver's application job to be cancelled",
                     lambda: scheduler_job(ready["app_job"], CHILD_TENANT)["state"] == "cancelled", CHILD_LEASE_S + 15)
        return ready, lapsed
    finally:
        proc.kill()
        proc.wait()


def run(tern):
    sc, session = spark(tern, tls_conf(as_text=True) if tern else [])
    try:
        results = {}
        for name, cases in [("rdd", lambda: rdd_cases(sc)), ("jvm", lambda: {} if SMOKE else run_jvm_cases(sc)),
                            ("sql", lambda: sql_cases(session)),
                            ("checksum", lambda: checksum_cases(sc, session))]:
            t = time.time()
            results.update(cases())
            print(f"  {'tern' if tern else 'builtin'} {name} cases: {time.time() - t:.1f}s", flush=True)
        return sc, session, results
    except BaseException:
        sc.stop()
        raise


def main():
    # Which Spark ran: the smoke test runs three lines in turn, and a failure's log starts here.
    print(f"Spark {pyspark.__version__}:", flush=True)
    data, input_checksum = (None, None) if SMOKE else teragen()
    failures = []

    sc, _, builtin = run(tern=False)
    try:
        if not SMOKE:
            report, valid = terasort(sc, data, "builtin")
            print("  builtin terasort:", report, valid, flush=True)
            if not valid["sorted"] or valid["checksum"] != input_checksum:
                failures.append(f"built-in terasort output invalid: {valid} (input checksum {input_checksum})")
    finally:
        sc.stop()

    sc, _, tern = run(tern=True)
    try:
        for name, expected in builtin.items():
            if tern[name] != expected:
                failures.append(f"{name}: Tern's result differs from the built-in shuffle's")
            else:
                print(f"  ok  {name}", flush=True)
        if not SMOKE:
            report, valid = terasort(sc, data, "tern")
            print("  tern terasort:", report, valid, flush=True)
            if not valid["sorted"] or valid["checksum"] != input_checksum or valid["records"] != report["records"]:
                failures.append(f"Tern terasort output invalid: {valid} (input checksum {input_checksum})")
            else:
                print("  ok  terasort output validates (checksum %s)" % input_checksum, flush=True)
        freed = frees_unregistered_shuffles(sc)
        print(f"  ok  unregistering {freed} shuffles freed all their blocks in Tern", flush=True)
        if STORAGE_FAULT:
            lost = survive_lost_server(sc)
            print(f"  ok  a storage server cut off: lost maps {lost} rerun in one map-stage attempt, result right",
                  flush=True)
        else:
            print("  not run: the storage-server fault (no TERN_STORAGE_FAULT: `tern up` stops when a daemon dies)",
                  flush=True)
        app_job = None
        if MASTER:
            app_job = sc._jsc.sc().schedulerBackend().ternJobId()
            killed = survive_killed_executor(sc)
            print(f"  ok  executor {killed} SIGKILLed mid-stage: Tern reported it, Spark reran its tasks, result "
                  "right, executor replaced", flush=True)
            t = time.time()
            ran_on = task_resource_profile(sc)
            print(f"  ok  a TaskResourceProfile without dynamic allocation ran on the default executors {ran_on} "
                  f"({time.time() - t:.1f}s)", flush=True)
        job = jvm_cases(sc).shuffleManager().ternJobId()
    finally:
        sc.stop()
    if app_job:
        status = scheduler_job(app_job)
        stage = status["stages"][0]
        assert status["state"] == "succeeded" and stage["attempts"] >= 3 and stage["failed"] >= 1, \
            f"the application's Tern job: {status}"
        assert status["tern_job_id"] == job, \
            f"the application's shuffles were in Tern job {job}, not in its scheduler job's {status['tern_job_id']}"
        killed_by = [e for e in stage["errors"] if "killed by signal 9 (SIGKILL)" in e]
        assert killed_by and not any("more than the" in e for e in stage["errors"]), \
            f"the SIGKILLed executor's task should be reported killed by a signal, not OOM: {stage['errors']}"
        print(f"  ok  the application ran as Tern job {app_job} ({status['name']}): {stage['attempts']} executor "
              f"tasks, {stage['failed']} killed (reported: {killed_by[0][:80]}...), succeeded at sc.stop()", flush=True)
    wait_for("the stopped application's bytes to be freed", lambda: held_bytes() == 0, 15)
    assert job not in {j["job_id"] for j in tern_status()["jobs"]}, f"Tern job {job} outlived sc.stop()"
    print(f"  ok  application end ended Tern job {job} and freed its blocks", flush=True)

    t = time.time()
    ready, lapsed = dynamic_allocation_and_crashed_driver()
    print(f"  ok  dynamic allocation: executors {ready['first_executors']} released, the shuffle read on "
          f"{ready['second_executors']} without recomputation (tenant {CHILD_TENANT}, 2 copies)", flush=True)
    print(f"  ok  a SIGKILLed driver's job {ready['job']} freed {lapsed:.1f}s after the kill "
          f"(lease {CHILD_LEASE_S}s); child run {time.time() - t:.1f}s", flush=True)
    if ready["app_job"]:
        print(f"  ok  its application job {ready['app_job']} on Tern's scheduler cancelled when its lease lapsed",
              flush=True)
    if MASTER and SMOKE:
        print("  not run: stage-level scheduling (TERN_SPARK_SMOKE: the full suite on Spark 4.3 runs it)", flush=True)
    if ready["profiled"]:
        p = ready["profiled"]
        print(f"  ok  stage-level scheduling: resource profile {p['profile']}'s stage read the shuffle on its own "
              f"executors {p['executors']} ({PROFILE_CORES} cores and a GPU, TaskContext.cpus() {PROFILE_CORES}), "
              f"Tern stage {p['stage']} granted {p['needs']} ({p['seconds']}s)", flush=True)

    if failures:
        print("FAILED:\n  " + "\n  ".join(failures), flush=True)
        sys.exit(1)
    print("all Spark cases agree", flush=True)


if __name__ == "__main__":
    child() if sys.argv[1:] == ["--child"] else main()

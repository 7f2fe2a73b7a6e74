package io.tern.spark;

import java.util.ArrayList;
import java.util.HashMap;
import java.util.List;
import java.util.Map;
import java.util.TreeMap;
import java.util.TreeSet;
import java.util.regex.Matcher;
import java.util.regex.Pattern;

import org.apache.spark.SparkConf;
import org.apache.spark.SparkConf$;
import org.apache.spark.SparkContext;
import org.apache.spark.resource.ExecutorResourceRequest;
import org.apache.spark.resource.ResourceProfile;
import org.apache.spark.scheduler.ExecutorExited;
import org.apache.spark.scheduler.ExecutorKilled$;
import org.apache.spark.scheduler.SparkListener;
import org.apache.spark.scheduler.SparkListenerExecutorAdded;
import org.apache.spark.scheduler.TaskSchedulerImpl;
import org.apache.spark.scheduler.cluster.SchedulerBackendUtils$;
import org.slf4j.Logger;
import org.slf4j.LoggerFactory;

import scala.Tuple2;
import scala.collection.JavaConverters;
import scala.concurrent.Future;
import scala.concurrent.Future$;

/**
 * A Spark application's executors as Tern tasks. At start the driver submits one Tern job (named
 * after the application, in {@code spark.tern.queue} at {@code spark.tern.priority}) whose elastic
 * stage "executors" runs one {@code spark-executor} task per executor of the default resource
 * profile; Tern's executors launch the {@code CoarseGrainedExecutorBackend} JVMs with the
 * profile's cores, memory (heap plus overhead plus PySpark memory: the task's memory grant,
 * enforced as Tern enforces any task's) and GPUs.
 *
 * <p>Stage-level scheduling: every resource profile Spark asks executors for (with dynamic
 * allocation, a stage whose RDD carries a {@code ResourceProfile}) gets an elastic stage of its
 * own, "executors-rp&lt;id&gt;", added to the job when Spark first asks for it, its tasks needing
 * that profile's executor resources ({@link Profile#of}). Spark accepts such profiles only on
 * masters it takes for YARN, Kubernetes or standalone: hence the master alias
 * {@code local-cluster-tern://} ({@link TernClusterManager}). A {@code TaskResourceProfile}
 * without dynamic allocation runs on the default profile's executors and needs nothing here.
 * The Spark executor id is {@code profile id * }{@link #ID_STRIDE}{@code  + task index} (unique in
 * the application, an integer, never reused).
 *
 * <p>Like Spark's Kubernetes backend, this one reconciles each profile: it keeps as many live tasks
 * (queued or running) as Spark's target for it; a target that drops cancels tasks that have not
 * registered yet (newest first), and registered executors go only when Spark kills them (a
 * cancel). A thread asks the scheduler every {@link #POLL_MS} ms which tasks ended: an executor
 * that ended without Spark killing it is removed with {@link ExecutorExited} and its reason (so its
 * tasks run again), and it is replaced while the target wants it. The job's lease is
 * {@code spark.tern.jobLease} (as the shuffles' Tern job): a driver that dies stops these calls,
 * and the scheduler cancels the job, stopping its executors. Executors that end before
 * registering, past {@code spark.tern.maxExecutorFailures}, fail the application instead of
 * looping.
 */
public final class TernSchedulerBackend extends SparkLine.CoarseGrainedBackend {
    /** The application's queue (a tenant's): Tern's weighted fair share applies between queues. */
    static final String QUEUE = "spark.tern.queue";
    /** Higher runs first within the queue. */
    static final String PRIORITY = "spark.tern.priority";
    /** Gang: the first N executors start together or none does (Volcano's minAvailable). */
    static final String GANG_MIN = "spark.tern.gang.minExecutors";
    /** Executors that end before registering, at most, before the application fails. */
    static final String MAX_FAILURES = "spark.tern.maxExecutorFailures";
    /** The java executable executors run [default: the driver's]. */
    static final String JAVA = "spark.tern.executor.java";
    /** SPARK_HOME on the executors' hosts [default: the driver's]. */
    static final String SPARK_HOME = "spark.tern.executor.sparkHome";

    /** How often the scheduler is asked which executor tasks ended. */
    static final long POLL_MS = 200;
    /**
     * A gang not started this long after submission is looked into (then every {@link #GANG_CHECK_MS}):
     * long enough for a pool to start executors for it, short enough that a user waiting on a
     * gang the executors cannot hold learns why.
     */
    static final long GANG_WARN_AFTER_MS = 5_000;
    static final long GANG_CHECK_MS = 2_000;
    /**
     * Executor ids of profile P are P * ID_STRIDE + task index: each profile's stage may run up to
     * this many tasks in its life (the scheduler's max_tasks_per_stage, 100,000 by default, is below).
     */
    static final int ID_STRIDE = 1_000_000;
    /** The highest resource profile id served: its executor ids still fit a Java int. */
    static final int MAX_PROFILE_ID = Integer.MAX_VALUE / ID_STRIDE - 1;
    /** Executors a default application asks for without dynamic allocation. */
    private static final int DEFAULT_EXECUTORS = 2;
    private static final Pattern EXIT_STATUS = Pattern.compile("exit status: (-?\\d+)");

    private static final Logger LOG = LoggerFactory.getLogger(TernSchedulerBackend.class);

    private final SparkContext sc;
    private final TaskSchedulerImpl taskScheduler;
    private final String schedulerAddr;
    private final String appId = "tern-" + System.currentTimeMillis();

    private long client;
    private String jobId;
    private Thread monitor;
    private volatile boolean stopping;
    /** Operator parameters every profile's executors share, and their environment. */
    private String[][] commonParams;
    private List<String[]> env;
    private long leaseMs;

    // All under `this`.
    /** Each resource profile's executors, by profile id (the default one from the start). */
    private final TreeMap<Integer, Profile> profiles = new TreeMap<>();
    /** Resource profiles Tern cannot serve (resources it does not grant, ids out of range). */
    private final java.util.Set<Integer> unserved = new java.util.HashSet<>();
    /** Executors that registered with the driver (their ids), whether or not Spark still has them. */
    private final java.util.Set<String> registered = new java.util.HashSet<>();
    /** When each executor's task was asked of the scheduler (driver clock, ms), for acquisition times. */
    private final Map<Integer, Long> requestedAt = new HashMap<>();
    /** spark.tern.gang.minExecutors (0: no gang). */
    private int gangMin;
    /** When the gang is next looked into (driver clock, ms), and what was last said about it. */
    private long gangCheckAtMs;
    private String gangBlocked = "";
    private int failuresBeforeRegistering;
    private int maxFailures;

    /** One resource profile's executors: one elastic stage of the application's job. */
    static final class Profile {
        final int id;
        /** Its stage in the Tern job. */
        final String stage;
        final int cores;
        final long heapMb;
        /** Overhead, PySpark and off-heap memory: the task's grant is heap plus this. */
        final long extraMb;
        final long gpus;
        /** Whether its stage exists in the job. */
        boolean created;
        /** Executors wanted (Spark's target for this profile). */
        int target;
        /** Tasks ever asked for (the next task index). */
        int asked;
        /** Task indexes queued or running, by our account. */
        final TreeSet<Integer> live = new TreeSet<>();
        /** Tasks Spark asked to kill, or that we cancelled: their end is expected. */
        final TreeSet<Integer> cancelled = new TreeSet<>();
        int endedNext;
        /** Why the scheduler refused its stage, once it did (then it is not asked again). */
        String refused;

        private Profile(int id, int cores, long heapMb, long extraMb, long gpus) {
            this.id = id;
            this.stage = id == ResourceProfile.DEFAULT_RESOURCE_PROFILE_ID() ? "executors" : "executors-rp" + id;
            this.cores = cores;
            this.heapMb = heapMb;
            this.extraMb = extraMb;
            this.gpus = gpus;
        }

        /**
         * A profile's executor resources as Spark's cluster managers work them out
         * (ResourceProfile.getResourcesForClusterManager): what the profile names, else the
         * application's conf: cores (spark.executor.cores, default 1: under a local-cluster master
         * Spark's default profile names no cores unless that key is set), heap, overhead
         * (spark.executor.memoryOverhead, else the overhead factor of this profile's heap, at least
         * 384 MiB), PySpark and off-heap memory, and GPUs (the only custom resource Tern grants).
         */
        static Profile of(ResourceProfile rp, SparkConf conf) {
            Map<String, ExecutorResourceRequest> res = rp.executorResourcesJMap();
            if (rp.id() < 0 || rp.id() > MAX_PROFILE_ID) {
                throw new IllegalArgumentException("resource profile " + rp.id() + ": Tern serves profile ids 0 to "
                        + MAX_PROFILE_ID);
            }
            for (String name : res.keySet()) {
                boolean known = name.equals("gpu") || java.util.Arrays.asList(
                        ResourceProfile.allSupportedExecutorResources()).contains(name);
                if (!known) {
                    throw new IllegalArgumentException("resource profile " + rp.id() + " asks for executor resource "
                            + name + "; Tern's scheduler grants cores, memory and gpu");
                }
            }
            int cores = res.containsKey(ResourceProfile.CORES()) ? (int) res.get(ResourceProfile.CORES()).amount()
                    : conf.getInt("spark.executor.cores", 1);
            long heapMb = res.containsKey(ResourceProfile.MEMORY()) ? res.get(ResourceProfile.MEMORY()).amount()
                    : conf.getSizeAsMb("spark.executor.memory", "1g");
            long overheadMb;
            if (res.containsKey(ResourceProfile.OVERHEAD_MEM())) {
                overheadMb = res.get(ResourceProfile.OVERHEAD_MEM()).amount();
            } else if (conf.contains("spark.executor.memoryOverhead")) {
                overheadMb = conf.getSizeAsMb("spark.executor.memoryOverhead", "384m");
            } else {
                overheadMb = Math.max(384, (long) (conf.getDouble("spark.executor.memoryOverheadFactor", 0.1) * heapMb));
            }
            long pysparkMb = res.containsKey(ResourceProfile.PYSPARK_MEM())
                    ? res.get(ResourceProfile.PYSPARK_MEM()).amount()
                    : conf.contains("spark.executor.pyspark.memory")
                            ? conf.getSizeAsMb("spark.executor.pyspark.memory", "0") : 0;
            // Off-heap memory lives outside the heap too (Spark's default profile carries the conf's).
            long offHeapMb = res.containsKey(ResourceProfile.OFFHEAP_MEM())
                    ? res.get(ResourceProfile.OFFHEAP_MEM()).amount() : 0;
            long gpus = res.containsKey("gpu") ? res.get("gpu").amount() : 0;
            if (cores <= 0 || heapMb <= 0 || gpus < 0) {
                throw new IllegalArgumentException("resource profile " + rp.id() + ": " + cores + " cores, " + heapMb
                        + " MiB heap, " + gpus + " GPUs; an executor needs cores and memory above 0");
            }
            return new Profile(rp.id(), cores, heapMb, overheadMb + pysparkMb + offHeapMb, gpus);
        }

        /** The Spark executor id of its task {@code task}. */
        int executorId(int task) {
            return id * ID_STRIDE + task;
        }

        long cpuMilli() {
            return cores * 1000L;
        }

        long memoryBytes() {
            return (heapMb + extraMb) << 20;
        }

        long gpuMilli() {
            return gpus * 1000;
        }

        /** Its executors' own operator parameters. */
        String[][] params() {
            return new String[][] {
                {"cores", Integer.toString(cores)},
                {"heap_bytes", Long.toString(heapMb << 20)},
                {"resource_profile_id", Integer.toString(id)},
                {"executor_id_base", Long.toString((long) id * ID_STRIDE)},
            };
        }

        @Override
        public String toString() {
            return "profile " + id + " (stage " + stage + "; executors of " + cores + " cores, " + heapMb + " MiB heap + "
                    + extraMb + " MiB overhead, " + gpus + " GPUs)";
        }
    }

    TernSchedulerBackend(TaskSchedulerImpl scheduler, SparkContext sc, String schedulerAddr) {
        super(scheduler, sc.env().rpcEnv());
        this.sc = sc;
        this.taskScheduler = scheduler;
        this.schedulerAddr = schedulerAddr;
    }

    @Override
    public String applicationId() {
        return appId;
    }

    @Override
    public void start() {
        super.start();
        SparkConf conf = sc.conf();
        String manager = conf.get("spark.shuffle.manager", "sort");
        if (!manager.equals(SparkLine.shuffleManagerClass())) {
            // Spark 3.5 makes the shuffle manager before it asks the cluster manager, so this
            // master cannot switch it on; executors that hold shuffle files would lose them.
            throw new IllegalArgumentException("Spark on Tern's scheduler needs Tern's shuffle (executors come "
                    + "and go): set spark.shuffle.manager=" + SparkLine.shuffleManagerClass()
                    + " and spark.shuffle.sort.io.plugin.class=" + TernShuffleDataIO.class.getName()
                    + " (spark.shuffle.manager is " + manager + ")");
        }
        NativeLibrary.load(TernConf.nativeDir(conf));
        int initial = SchedulerBackendUtils$.MODULE$.getInitialTargetExecutorNumber(conf, DEFAULT_EXECUTORS);
        int gang = conf.getInt(GANG_MIN, 0);
        if (gang < 0) {
            throw new IllegalArgumentException(GANG_MIN + " = " + gang + ": must be >= 0");
        }
        initial = Math.max(initial, gang);
        maxFailures = conf.getInt(MAX_FAILURES, Math.max(3, 2 * initial));
        Profile first = Profile.of(sc.resourceProfileManager().defaultResourceProfile(), conf);

        String sparkHome = conf.get(SPARK_HOME, System.getenv("SPARK_HOME") == null ? "" : System.getenv("SPARK_HOME"));
        if (sparkHome.isEmpty()) {
            throw new IllegalArgumentException("SPARK_HOME is not set: set " + SPARK_HOME
                    + " to the Spark installation on the executors' hosts");
        }
        String java = conf.get(JAVA, System.getProperty("java.home") + "/bin/java");
        String extra = conf.get("spark.executor.extraClassPath", "");
        String classpath = (extra.isEmpty() ? "" : extra + ":") + sparkHome + "/jars/*";
        StringBuilder options = new StringBuilder();
        for (Tuple2<String, String> kv : conf.getAll()) {
            // What an executor must know before it fetches the rest from the driver (as
            // Spark's standalone workers pass it).
            if (SparkConf$.MODULE$.isExecutorStartupConf(kv._1())) {
                options.append("-D").append(kv._1()).append('=').append(kv._2()).append('\n');
            }
        }
        for (String option : JavaConverters.seqAsJavaListConverter(
                org.apache.spark.util.Utils.splitCommandString(conf.get("spark.executor.extraJavaOptions", "")))
                .asJava()) {
            options.append(option).append('\n');
        }
        String driverUrl = "spark://CoarseGrainedScheduler@" + conf.get("spark.driver.host") + ":"
                + conf.get("spark.driver.port");
        commonParams = new String[][] {
            {"driver_url", driverUrl},
            {"app_id", appId},
            {"classpath", classpath},
            {"java", java},
            {"java_options", options.toString()},
        };
        env = new ArrayList<>();
        env.add(new String[] {"SPARK_HOME", sparkHome});
        for (String name : new String[] {"PYTHONPATH", "PYSPARK_PYTHON", "SPARK_LOCAL_DIRS"}) {
            String value = System.getenv(name);
            if (value != null) {
                env.add(new String[] {name, value});
            }
        }
        leaseMs = Math.max(conf.getTimeAsMs(TernConf.JOB_LEASE, "30s"), 10 * POLL_MS);
        sc.addSparkListener(new SparkListener() {
            @Override
            public void onExecutorAdded(SparkListenerExecutorAdded added) {
                synchronized (TernSchedulerBackend.this) {
                    registered.add(added.executorId());
                }
            }
        });
        TernConf tern = new TernConf(conf);
        client = TernSchedulerNative.connect(schedulerAddr, tern.tlsDir, tern.tlsCa, tern.tlsCert, tern.tlsSecretKey,
                tern.credentialFile);
        synchronized (this) {
            long asked = System.currentTimeMillis();
            String[][] params = params(first);
            String[] submitted = TernSchedulerNative.submit(client, jobName(sc.appName()), conf.get(QUEUE, ""),
                    conf.getInt(PRIORITY, 0), first.cpuMilli(), first.memoryBytes(), first.gpuMilli(), initial, gang,
                    leaseMs, column(params, 0), column(params, 1), column(env, 0), column(env, 1)).split("\n", 3);
            jobId = submitted[0];
            gangMin = gang;
            gangCheckAtMs = asked + GANG_WARN_AFTER_MS;
            adoptShuffleJob(conf, submitted[1], submitted[2]);
            first.created = true;
            first.target = initial;
            first.asked = initial;
            for (int i = 0; i < initial; i++) {
                first.live.add(i);
                requestedAt.put(first.executorId(i), asked);
            }
            profiles.put(first.id, first);
        }
        LOG.info("Spark application {} is Tern job {} on scheduler {}: {} executors of the default {}", appId, jobId,
                schedulerAddr, initial, first);
        monitor = new Thread(this::watch, "tern-executors");
        monitor.setDaemon(true);
        monitor.start();
    }

    /** The operator parameters of a profile's executors. */
    private String[][] params(Profile p) {
        String[][] own = p.params();
        String[][] all = new String[commonParams.length + own.length][];
        System.arraycopy(commonParams, 0, all, 0, commonParams.length);
        System.arraycopy(own, 0, all, commonParams.length, own.length);
        return all;
    }

    /**
     * Puts the application's shuffles in its scheduler job's own Tern job (one Tern job per
     * application: ending or cancelling the application frees its shuffles with its executors),
     * unless {@code spark.tern.tenant} names another tenant than the queue (the scheduler starts
     * that Tern job in the queue's tenant): then the shuffle manager keeps its own job in its tenant.
     */
    private void adoptShuffleJob(SparkConf conf, String ternJobId, String token) {
        String tenant = conf.get(TernConf.TENANT, "");
        String queue = conf.get(QUEUE, "");
        if (!tenant.isEmpty() && !tenant.equals(queue)) {
            LOG.info("the application's shuffles stay in a Tern job of tenant {} ({}), not in its scheduler job's "
                    + "(queue {})", tenant, TernConf.TENANT, queue.isEmpty() ? "default" : queue);
            return;
        }
        TernShuffleManager manager = (TernShuffleManager) sc.env().shuffleManager();
        if (!manager.adoptJob(ternJobId, token)) {
            LOG.warn("the shuffle manager already holds a Tern job; the application's shuffles stay there");
        }
    }

    /**
     * When executor {@code executorId}'s Tern task was asked of the scheduler (driver clock, ms
     * since the epoch), or -1 if this backend did not ask for it (for `tern bench spark-pool`).
     */
    public synchronized long requestedAtMs(String executorId) {
        try {
            return requestedAt.getOrDefault(Integer.parseInt(executorId), -1L);
        } catch (NumberFormatException e) {
            return -1;
        }
    }

    /** The Tern job's id (for tests and logs). */
    public synchronized String ternJobId() {
        return jobId;
    }

    @Override
    public Future<Object> doRequestTotalExecutors(scala.collection.immutable.Map<ResourceProfile, Object> totals) {
        Map<ResourceProfile, Object> wanted = JavaConverters.mapAsJavaMapConverter(totals).asJava();
        try {
            synchronized (this) {
                boolean served = true;
                // Profiles Spark leaves out keep their target (as Spark's Kubernetes backend does).
                for (Map.Entry<ResourceProfile, Object> e : wanted.entrySet()) {
                    int n = (Integer) e.getValue();
                    int id = e.getKey().id();
                    if (unserved.contains(id)) {
                        served &= n == 0;
                        continue;
                    }
                    Profile p = profiles.get(id);
                    if (p == null) {
                        try {
                            p = Profile.of(e.getKey(), sc.conf());
                        } catch (IllegalArgumentException refused) {
                            unserved.add(id);
                            LOG.error("not serving resource profile {}: {}", id, refused.getMessage());
                            served &= n == 0;
                            continue;
                        }
                        profiles.put(id, p);
                        LOG.info("Spark asks for executors of resource {}", p);
                    }
                    p.target = n;
                }
                for (Profile p : profiles.values()) {
                    served &= reconcile(p);
                }
                return Future$.MODULE$.successful(served);
            }
        } catch (TernException e) {
            LOG.warn("asking Tern's scheduler for executors {} failed: {}", wanted, e.getMessage());
            return Future$.MODULE$.successful(Boolean.FALSE);
        }
    }

    @Override
    Future<Object> killExecutors(List<String> ids) {
        Map<Integer, List<Integer>> kill = new TreeMap<>();
        for (String id : ids) {
            int executor;
            try {
                executor = Integer.parseInt(id);
            } catch (NumberFormatException e) {
                LOG.warn("asked to kill executor {}, which Tern did not start", id);
                continue;
            }
            kill.computeIfAbsent(executor / ID_STRIDE, k -> new ArrayList<>()).add(executor % ID_STRIDE);
            removeExecutor(id, ExecutorKilled$.MODULE$);
        }
        try {
            synchronized (this) {
                for (Map.Entry<Integer, List<Integer>> e : kill.entrySet()) {
                    Profile p = profiles.get(e.getKey());
                    if (p == null || !p.created) {
                        LOG.warn("asked to kill executors {} of resource profile {}, which Tern did not start",
                                e.getValue(), e.getKey());
                        continue;
                    }
                    cancel(p, e.getValue());
                }
            }
            return Future$.MODULE$.successful(Boolean.TRUE);
        } catch (TernException e) {
            LOG.warn("cancelling executors {} (profile: task indexes) failed: {}", kill, e.getMessage());
            return Future$.MODULE$.successful(Boolean.FALSE);
        }
    }

    @Override
    public void stop() {
        stopping = true;
        try {
            super.stop();
        } finally {
            if (monitor != null) {
                monitor.interrupt();
            }
            synchronized (this) {
                if (client != 0) {
                    // The job succeeds once every stage is finished; executors still running are
                    // stopped by Tern.
                    for (Profile p : profiles.values()) {
                        if (!p.created) {
                            continue;
                        }
                        try {
                            TernSchedulerNative.scale(client, jobId, p.stage, 0, new int[0], true, p.endedNext);
                        } catch (TernException e) {
                            LOG.warn("ending stage {} of Tern job {} failed: {}", p.stage, jobId, e.getMessage());
                        }
                    }
                    TernSchedulerNative.closeScheduler(client);
                    client = 0;
                }
            }
        }
    }

    /**
     * Adds or cancels a profile's not-yet-registered tasks until its live tasks match its target,
     * adding its stage to the job first if need be. False when the profile cannot be served.
     * Under `this`.
     */
    private boolean reconcile(Profile p) {
        if (p.refused != null) {
            return p.target == 0;
        }
        int missing = p.target - p.live.size();
        if (missing > 0) {
            if (!p.created) {
                String[][] params = params(p);
                String reply;
                try {
                    reply = TernSchedulerNative.createStage(client, jobId, p.stage, p.cpuMilli(), p.memoryBytes(),
                            p.gpuMilli(), leaseMs, column(params, 0), column(params, 1), column(env, 0), column(env, 1));
                } catch (TernException e) {
                    if (!"invalid".equals(e.kind())) {
                        throw e;
                    }
                    // Past the scheduler's stage limit, say: asking again would not help.
                    p.refused = e.getMessage();
                    LOG.error("Tern's scheduler refused executors of resource {}: {}", p, p.refused);
                    return false;
                }
                p.created = true;
                apply(p, reply);
                LOG.info("Tern job {} now has stage {} for resource {}", jobId, p.stage, p);
            }
            int room = ID_STRIDE - p.asked;
            if (missing > room) {
                LOG.error("resource profile {} asked for {} executors in its life; at most {}", p.id, p.asked + missing,
                        ID_STRIDE);
                missing = room;
            }
            if (missing > 0) {
                long asked = System.currentTimeMillis();
                for (int task : apply(p, TernSchedulerNative.scale(client, jobId, p.stage, missing, new int[0], false,
                        p.endedNext))) {
                    requestedAt.put(p.executorId(task), asked);
                }
            }
        } else if (missing < 0) {
            List<Integer> drop = new ArrayList<>();
            for (Integer t : p.live.descendingSet()) {
                if (drop.size() == -missing) {
                    break;
                }
                if (!isExecutorActive(Integer.toString(p.executorId(t)))) {
                    drop.add(t);
                }
            }
            if (!drop.isEmpty()) {
                cancel(p, drop);
            }
        }
        return true;
    }

    /** Cancels a profile's tasks. Under `this`. */
    private void cancel(Profile p, List<Integer> tasks) {
        int[] indexes = new int[tasks.size()];
        for (int i = 0; i < indexes.length; i++) {
            indexes[i] = tasks.get(i);
            p.cancelled.add(indexes[i]);
            p.live.remove(indexes[i]);
        }
        apply(p, TernSchedulerNative.scale(client, jobId, p.stage, 0, indexes, false, p.endedNext));
    }

    /** Applies a ScaleStage reply about a profile's stage: tasks added (returned), tasks ended. Under `this`. */
    private List<Integer> apply(Profile p, String reply) {
        String[] lines = reply.split("\n");
        String[] head = lines[0].split(" ");
        p.endedNext = Integer.parseInt(head[3]);
        List<Integer> addedTasks = new ArrayList<>();
        for (String added : lines[1].split(" ")) {
            if (!added.equals("added")) {
                int task = Integer.parseInt(added);
                p.live.add(task);
                p.asked = Math.max(p.asked, task + 1);
                addedTasks.add(task);
            }
        }
        for (int i = 2; i < lines.length; i++) {
            String[] parts = lines[i].split(" ", 4);
            int task = Integer.parseInt(parts[1]);
            String outcome = parts[2];
            String message = parts.length > 3 ? parts[3] : "";
            p.live.remove(task);
            requestedAt.remove(p.executorId(task));
            if (p.cancelled.remove(task) || stopping) {
                continue;
            }
            String id = Integer.toString(p.executorId(task));
            String reason = "Tern task " + task + " of stage " + p.stage + " of job " + jobId + " ended (" + outcome
                    + "): " + message;
            if (registered.contains(id)) {
                LOG.warn("executor {} is gone: {}", id, reason);
                removeExecutor(id, new ExecutorExited(exitCode(outcome, message), !outcome.equals("LOST"), reason));
            } else if (++failuresBeforeRegistering > maxFailures) {
                taskScheduler.error(failuresBeforeRegistering + " executors ended before registering with the driver "
                        + "(" + MAX_FAILURES + " = " + maxFailures + "); the last: " + reason);
            } else {
                LOG.warn("executor {} ended before it registered: {}", id, reason);
            }
        }
        if (!head[1].equals("RUNNING") && !head[1].equals("PENDING") && !stopping) {
            // Cancelled from outside (tern job cancel, a lapsed lease): the application ends, as a
            // standalone application the master killed does.
            stopping = true;
            String why = "Tern job " + jobId + " of this application is " + head[1].toLowerCase()
                    + " (tern job cancel?); stopping the application";
            LOG.error(why);
            try {
                taskScheduler.error(why);
            } catch (Exception noActiveJobs) {
                // error() throws (a SparkException, checked or not) when no job runs; the stop
                // below still ends the application.
            }
            sc.stopInNewThread();
        }
        return addedTasks;
    }

    /** The executor's exit status as its report tells it (137 for SIGKILL; -1 when unknown). */
    static int exitCode(String outcome, String message) {
        Matcher m = EXIT_STATUS.matcher(message);
        if (m.find()) {
            return Integer.parseInt(m.group(1));
        }
        return message.contains("SIGKILL") || outcome.equals("OOM") ? 137 : -1;
    }

    /**
     * While a gang has no executor registered: asks the scheduler, every GANG_CHECK_MS from
     * GANG_WARN_AFTER_MS on, why its tasks cannot start, and warns (once per different reason)
     * when the live executors cannot hold the gang, so that a gang larger than the pool is not a
     * silent wait (the scheduler keeps it queued, as Volcano keeps an unschedulable podgroup:
     * executors may still join). Under `this`.
     */
    private void checkGang() {
        if (gangMin == 0 || !registered.isEmpty() || System.currentTimeMillis() < gangCheckAtMs) {
            return;
        }
        gangCheckAtMs = System.currentTimeMillis() + GANG_CHECK_MS;
        String why = TernSchedulerNative.blocked(client, jobId);
        if (!why.isEmpty() && !why.equals(gangBlocked)) {
            LOG.warn("the application's gang of {} executors ({} = {}) cannot start on Tern's executors now: {} "
                    + "(tern job status {}); no executor starts until {} fit at once", gangMin, GANG_MIN, gangMin,
                    why, jobId, gangMin);
        } else if (why.isEmpty() && !gangBlocked.isEmpty()) {
            LOG.info("the application's gang of {} executors fits on Tern's executors now", gangMin);
        }
        gangBlocked = why;
    }

    /** Every POLL_MS: each profile's ended tasks, then replacements while its target wants them. */
    private void watch() {
        while (!stopping) {
            try {
                Thread.sleep(POLL_MS);
                synchronized (this) {
                    for (Profile p : profiles.values()) {
                        if (stopping || client == 0) {
                            return;
                        }
                        if (p.created) {
                            apply(p, TernSchedulerNative.scale(client, jobId, p.stage, 0, new int[0], false,
                                    p.endedNext));
                        }
                        if (!stopping) {
                            reconcile(p);
                        }
                    }
                    if (!stopping) {
                        checkGang();
                    }
                }
            } catch (InterruptedException e) {
                return;
            } catch (TernException e) {
                LOG.warn("asking Tern's scheduler about executors failed (retrying): {}", e.getMessage());
            } catch (RuntimeException e) {
                LOG.error("the Tern executor monitor failed", e);
            }
        }
    }

    /** A Tern job name for the application: [A-Za-z0-9._-], at most 128 bytes. */
    static String jobName(String appName) {
        String name = ("spark-" + appName).replaceAll("[^A-Za-z0-9._-]", "_");
        return name.length() > 128 ? name.substring(0, 128) : name;
    }

    private static String[] column(String[][] rows, int i) {
        String[] out = new String[rows.length];
        for (int r = 0; r < rows.length; r++) {
            out[r] = rows[r][i];
        }
        return out;
    }

    private static String[] column(List<String[]> rows, int i) {
        return column(rows.toArray(new String[0][]), i);
    }
}

package io.tern.spark;

import java.util.ArrayList;
import java.util.HashMap;
import java.util.List;
import java.util.Map;
import java.util.TreeSet;
import java.util.regex.Matcher;
import java.util.regex.Pattern;

import org.apache.spark.SparkConf;
import org.apache.spark.SparkConf$;
import org.apache.spark.SparkContext;
import org.apache.spark.resource.ResourceProfile;
import org.apache.spark.scheduler.ExecutorExited;
import org.apache.spark.scheduler.ExecutorKilled$;
import org.apache.spark.scheduler.SparkListener;
import org.apache.spark.scheduler.SparkListenerExecutorAdded;
import org.apache.spark.scheduler.TaskSchedulerImpl;
import org.apache.spark.scheduler.cluster.CoarseGrainedSchedulerBackend;
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
 * stage runs one {@code spark-executor} task per executor; Tern's executors launch the
 * {@code CoarseGrainedExecutorBackend} JVMs with the application's cores, memory (heap plus
 * overhead, the task's memory grant, enforced as Tern enforces any task's) and GPUs. The Spark
 * executor id is the task's index (never reused).
 *
 * <p>Like Spark's Kubernetes backend, this one reconciles: it keeps as many live tasks (queued or
 * running) as Spark's target; a target that drops cancels tasks that have not registered yet
 * (newest first), and registered executors go only when Spark kills them (a cancel). A thread
 * asks the scheduler every {@link #POLL_MS} ms which tasks ended: an executor that ended without
 * Spark killing it is removed with {@link ExecutorExited} and its reason (so its tasks run again),
 * and it is replaced while the target wants it. The job's lease is {@code spark.tern.jobLease} (as the
 * shuffles' Tern job): a driver that dies stops these calls, and the scheduler cancels the job,
 * stopping its executors. Executors that end before registering, past
 * {@code spark.tern.maxExecutorFailures}, fail the application instead of looping.
 *
 * <p>Only the default resource profile is served: stage-level scheduling with other profiles is
 * refused with an error rather than run on the wrong executors. (Spark 3.5's
 * ResourceProfileManager refuses non-default profiles itself on masters other than YARN,
 * Kubernetes and standalone, so a tern:// application cannot make one outside Spark's tests.)
 */
public final class TernSchedulerBackend extends CoarseGrainedSchedulerBackend {
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

    // All under `this`.
    /** Executors wanted (Spark's target for the default profile). */
    private int target;
    /** Task indexes queued or running, by our account. */
    private final TreeSet<Integer> live = new TreeSet<>();
    /** Tasks Spark asked to kill, or that we cancelled: their end is expected. */
    private final TreeSet<Integer> cancelled = new TreeSet<>();
    /** Executors that registered with the driver (their ids), whether or not Spark still has them. */
    private final java.util.Set<String> registered = new java.util.HashSet<>();
    /** When each task was asked of the scheduler (driver clock, ms), for acquisition times. */
    private final Map<Integer, Long> requestedAt = new HashMap<>();
    private int endedNext;
    /** spark.tern.gang.minExecutors (0: no gang). */
    private int gangMin;
    /** When the gang is next looked into (driver clock, ms), and what was last said about it. */
    private long gangCheckAtMs;
    private String gangBlocked = "";
    private int failuresBeforeRegistering;
    private int maxFailures;

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
        if (!manager.equals(TernShuffleManager.class.getName())) {
            // Spark 3.5 makes the shuffle manager before it asks the cluster manager, so this
            // master cannot switch it on; executors that hold shuffle files would lose them.
            throw new IllegalArgumentException("Spark on Tern's scheduler needs Tern's shuffle (executors come "
                    + "and go): set spark.shuffle.manager=" + TernShuffleManager.class.getName()
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
        int cores = conf.getInt("spark.executor.cores", 1);
        long heapMb = conf.getSizeAsMb("spark.executor.memory", "1g");
        long overheadMb = conf.contains("spark.executor.memoryOverhead")
                ? conf.getSizeAsMb("spark.executor.memoryOverhead", "384m")
                : Math.max(384, (long) (conf.getDouble("spark.executor.memoryOverheadFactor", 0.1) * heapMb));
        long pysparkMb = conf.contains("spark.executor.pyspark.memory")
                ? conf.getSizeAsMb("spark.executor.pyspark.memory", "0") : 0;
        long gpus = conf.getLong("spark.executor.resource.gpu.amount", 0);

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
        String[][] params = {
            {"driver_url", driverUrl},
            {"app_id", appId},
            {"cores", Integer.toString(cores)},
            {"classpath", classpath},
            {"heap_bytes", Long.toString(heapMb << 20)},
            {"java", java},
            {"java_options", options.toString()},
            {"resource_profile_id", Integer.toString(ResourceProfile.DEFAULT_RESOURCE_PROFILE_ID())},
        };
        List<String[]> env = new ArrayList<>();
        env.add(new String[] {"SPARK_HOME", sparkHome});
        for (String name : new String[] {"PYTHONPATH", "PYSPARK_PYTHON", "SPARK_LOCAL_DIRS"}) {
            String value = System.getenv(name);
            if (value != null) {
                env.add(new String[] {name, value});
            }
        }
        sc.addSparkListener(new SparkListener() {
            @Override
            public void onExecutorAdded(SparkListenerExecutorAdded added) {
                synchronized (TernSchedulerBackend.this) {
                    registered.add(added.executorId());
                }
            }
        });
        TernConf tern = new TernConf(conf);
        client = TernSchedulerNative.connect(schedulerAddr, tern.tlsDir, tern.tlsCa, tern.tlsCert, tern.tlsSecretKey);
        synchronized (this) {
            long asked = System.currentTimeMillis();
            String[] submitted = TernSchedulerNative.submit(client, jobName(sc.appName()), conf.get(QUEUE, ""),
                    conf.getInt(PRIORITY, 0), cores * 1000L, (heapMb + overheadMb + pysparkMb) << 20, gpus * 1000,
                    initial, gang, Math.max(conf.getTimeAsMs(TernConf.JOB_LEASE, "30s"), 10 * POLL_MS),
                    column(params, 0), column(params, 1), column(env, 0), column(env, 1)).split("\n", 3);
            jobId = submitted[0];
            gangMin = gang;
            gangCheckAtMs = asked + GANG_WARN_AFTER_MS;
            adoptShuffleJob(conf, submitted[1], submitted[2]);
            target = initial;
            for (int i = 0; i < initial; i++) {
                live.add(i);
                requestedAt.put(i, asked);
            }
        }
        LOG.info("Spark application {} is Tern job {} on scheduler {}: {} executors of {} cores, {} MiB heap + {} MiB "
                + "overhead, {} GPUs", appId, jobId, schedulerAddr, initial, cores, heapMb, overheadMb + pysparkMb, gpus);
        monitor = new Thread(this::watch, "tern-executors");
        monitor.setDaemon(true);
        monitor.start();
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
        int wanted = 0;
        for (Map.Entry<ResourceProfile, Object> e : JavaConverters.mapAsJavaMapConverter(totals).asJava().entrySet()) {
            int n = (Integer) e.getValue();
            if (e.getKey().id() != ResourceProfile.DEFAULT_RESOURCE_PROFILE_ID()) {
                if (n > 0) {
                    LOG.error("Tern's cluster manager serves only the default resource profile; profile {} is not "
                            + "served", e.getKey().id());
                    return Future$.MODULE$.successful(Boolean.FALSE);
                }
                continue;
            }
            wanted = n;
        }
        try {
            synchronized (this) {
                target = wanted;
                reconcile();
            }
            return Future$.MODULE$.successful(Boolean.TRUE);
        } catch (TernException e) {
            LOG.warn("asking Tern's scheduler for {} executors failed: {}", wanted, e.getMessage());
            return Future$.MODULE$.successful(Boolean.FALSE);
        }
    }

    @Override
    public Future<Object> doKillExecutors(scala.collection.Seq<String> ids) {
        List<Integer> kill = new ArrayList<>();
        for (String id : JavaConverters.seqAsJavaListConverter(ids).asJava()) {
            try {
                kill.add(Integer.parseInt(id));
            } catch (NumberFormatException e) {
                LOG.warn("asked to kill executor {}, which Tern did not start", id);
                continue;
            }
            removeExecutor(id, ExecutorKilled$.MODULE$);
        }
        try {
            synchronized (this) {
                cancel(kill);
            }
            return Future$.MODULE$.successful(Boolean.TRUE);
        } catch (TernException e) {
            LOG.warn("cancelling executors {} failed: {}", kill, e.getMessage());
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
                    try {
                        // The job succeeds; executors still running are stopped by Tern.
                        TernSchedulerNative.scale(client, jobId, 0, new int[0], true, endedNext);
                    } catch (TernException e) {
                        LOG.warn("ending Tern job {} failed: {}", jobId, e.getMessage());
                    }
                    TernSchedulerNative.closeScheduler(client);
                    client = 0;
                }
            }
        }
    }

    /** Adds or cancels not-yet-registered tasks until live tasks match the target. Under `this`. */
    private void reconcile() {
        int missing = target - live.size();
        if (missing > 0) {
            long asked = System.currentTimeMillis();
            for (int task : apply(TernSchedulerNative.scale(client, jobId, missing, new int[0], false, endedNext))) {
                requestedAt.put(task, asked);
            }
        } else if (missing < 0) {
            List<Integer> drop = new ArrayList<>();
            for (Integer t : live.descendingSet()) {
                if (drop.size() == -missing) {
                    break;
                }
                if (!isExecutorActive(Integer.toString(t))) {
                    drop.add(t);
                }
            }
            if (!drop.isEmpty()) {
                cancel(drop);
            }
        }
    }

    /** Cancels tasks. Under `this`. */
    private void cancel(List<Integer> tasks) {
        int[] indexes = new int[tasks.size()];
        for (int i = 0; i < indexes.length; i++) {
            indexes[i] = tasks.get(i);
            cancelled.add(indexes[i]);
            live.remove(indexes[i]);
        }
        apply(TernSchedulerNative.scale(client, jobId, 0, indexes, false, endedNext));
    }

    /** Applies a ScaleStage reply: tasks added (returned), tasks ended. Under `this`. */
    private List<Integer> apply(String reply) {
        String[] lines = reply.split("\n");
        String[] head = lines[0].split(" ");
        endedNext = Integer.parseInt(head[3]);
        List<Integer> addedTasks = new ArrayList<>();
        for (String added : lines[1].split(" ")) {
            if (!added.equals("added")) {
                live.add(Integer.parseInt(added));
                addedTasks.add(Integer.parseInt(added));
            }
        }
        for (int i = 2; i < lines.length; i++) {
            String[] parts = lines[i].split(" ", 4);
            int task = Integer.parseInt(parts[1]);
            String outcome = parts[2];
            String message = parts.length > 3 ? parts[3] : "";
            live.remove(task);
            requestedAt.remove(task);
            if (cancelled.remove(task) || stopping) {
                continue;
            }
            String id = Integer.toString(task);
            String reason = "Tern task " + task + " of job " + jobId + " ended (" + outcome + "): " + message;
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

    /** Every POLL_MS: ended tasks, then replacements while the target wants them. */
    private void watch() {
        while (!stopping) {
            try {
                Thread.sleep(POLL_MS);
                synchronized (this) {
                    if (stopping || client == 0) {
                        return;
                    }
                    apply(TernSchedulerNative.scale(client, jobId, 0, new int[0], false, endedNext));
                    if (!stopping) {
                        reconcile();
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

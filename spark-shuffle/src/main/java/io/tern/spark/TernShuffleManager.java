package io.tern.spark;

import java.util.Map;
import java.util.concurrent.ConcurrentHashMap;

import org.apache.spark.ShuffleDependency;
import org.apache.spark.MapOutputTrackerMaster;
import org.apache.spark.ShuffleStatus;
import org.apache.spark.SparkConf;
import org.apache.spark.SparkContext;
import org.apache.spark.SparkEnv;
import org.apache.spark.TaskContext;
import org.apache.spark.network.buffer.ManagedBuffer;
import org.apache.spark.network.shuffle.MergedBlockMeta;
import org.apache.spark.rpc.RpcEndpointRef;
import org.apache.spark.scheduler.MapStatus;
import org.apache.spark.shuffle.ShuffleBlockResolver;
import org.apache.spark.shuffle.ShuffleHandle;
import org.apache.spark.shuffle.ShuffleManager;
import org.apache.spark.shuffle.ShuffleReadMetricsReporter;
import org.apache.spark.shuffle.ShuffleReader;
import org.apache.spark.shuffle.ShuffleWriteMetricsReporter;
import org.apache.spark.shuffle.ShuffleWriter;
import org.apache.spark.storage.BlockId;
import org.apache.spark.storage.ShuffleMergedBlockId;
import org.apache.spark.util.RpcUtils;
import org.slf4j.Logger;
import org.slf4j.LoggerFactory;

import scala.Option;
import scala.reflect.ClassTag$;

/**
 * Spark's shuffle on Tern ({@code spark.shuffle.manager=io.tern.spark.TernShuffleManager}; on
 * Spark 4.3 and later its subclass {@link TernBlockingShuffleManager}, which {@link SparkLine}
 * names).
 *
 * <p>The driver holds one Tern job (named after the application, its lease renewed in the
 * background) and registers one Tern shuffle per Spark shuffle under it; unregisterShuffle frees
 * the shuffle's data and stop() ends the job, freeing everything; a driver that dies stops renewing
 * and Tern frees the job when the lease lapses. Executors open shuffles by Tern id from the handle.
 * On Tern's scheduler the job is the application's own ({@link #adoptJob}): the scheduler renews
 * and ends it.
 *
 * <p>Lost data: the driver also serves {@link TernDriverEndpoint}, through which a reader that hit
 * lost data has every lost map output of the shuffle unregistered at once (see
 * {@link #unregisterLostMaps}), so one map-stage resubmission recomputes them all.
 *
 * <p>Space: a push Tern refuses for space waits up to {@code spark.tern.spaceWait} for room, and
 * meanwhile has the driver collect garbage so Spark's ContextCleaner unregisters (and so frees in
 * Tern) the shuffles nothing references ({@link TernCleaner}, which also does so when the
 * application's shuffle bytes pass {@code spark.tern.cleanerThreshold}); a task whose wait runs out
 * has the driver cancel its stage with a message saying what is full and what to do
 * ({@link #failStageForSpace}).
 */
public class TernShuffleManager implements ShuffleManager {
    private static final Logger LOG = LoggerFactory.getLogger(TernShuffleManager.class);

    private final SparkConf sparkConf;
    private final TernConf conf;
    private final boolean isDriver;
    private final ShuffleBlockResolver resolver = new NoBlocks();
    /** Tern shuffle id -> open native shuffle handle. */
    private final Map<Long, Long> shuffles = new ConcurrentHashMap<>();
    /** Spark shuffle id -> Tern shuffle id. */
    private final Map<Integer, Long> ternIds = new ConcurrentHashMap<>();
    /** Job tokens given to this process's client (from shuffle handles). */
    private final java.util.Set<String> tokens = ConcurrentHashMap.newKeySet();
    private long client;
    private long job;
    private String jobId;
    /**
     * Set when the driver's shuffles go in a Tern job someone else holds (the application's job
     * on Tern's scheduler, which renews and ends it): not started, renewed or ended here.
     */
    private boolean adopted;
    private boolean stopped;
    /** The driver's endpoint: served here on the driver, looked up on executors. */
    private RpcEndpointRef endpoint;
    /** Driver side: the application's context and the cleaner listening to it (from the first shuffle on). */
    private SparkContext sparkContext;
    private TernCleaner cleaner;
    /** Driver side: stages cancelled for want of space (each once, however many tasks report it). */
    private final java.util.Set<Integer> stagesFailedForSpace = ConcurrentHashMap.newKeySet();
    /** When this process last told the driver a push waits for space (ms since the epoch). */
    private static final java.util.concurrent.atomic.AtomicLong LAST_SPACE_REPORT_MS =
            new java.util.concurrent.atomic.AtomicLong();
    /** This process tells the driver a push waits for space at most once per this many ms. */
    private static final long SPACE_REPORT_INTERVAL_MS = 1000;

    public TernShuffleManager(SparkConf conf, boolean isDriver) {
        SparkLine.requireSupported();
        SparkLine.requireManagerShape(this);
        LOG.info("libtern_spark loaded from {}", NativeLibrary.load(TernConf.nativeDir(conf)));
        this.sparkConf = conf;
        this.conf = new TernConf(conf);
        this.isDriver = isDriver;
        this.conf.requireMetadata();
    }

    TernConf conf() {
        return conf;
    }

    synchronized long client() {
        if (stopped) {
            throw new IllegalStateException("TernShuffleManager is stopped");
        }
        if (client == 0) {
            client = TernNative.connect(
                    conf.requireMetadata(),
                    conf.transport,
                    conf.tlsDir,
                    conf.tlsCa,
                    conf.tlsCert,
                    conf.tlsSecretKey,
                    conf.tenant,
                    // Only the driver registers the application's job: executors act with its
                    // token, so the credential file need not be on their hosts.
                    isDriver ? conf.credentialFile : "");
        }
        return client;
    }

    /**
     * Puts the driver's shuffles in an existing Tern job whose token is {@code token} (the
     * application's job on Tern's scheduler) instead of a job of its own; false if this manager
     * already has a job (a shuffle came first).
     */
    public synchronized boolean adoptJob(String ternJobId, String token) {
        if (job != 0 || jobId != null) {
            return false;
        }
        TernNative.addJobToken(client(), token);
        jobId = ternJobId;
        adopted = true;
        LOG.info("Tern job {} (the application's job on Tern's scheduler) holds this application's shuffles", jobId);
        return true;
    }

    /** The driver's job, started on the first shuffle (the app id is set by then). */
    private synchronized String jobId() {
        if (job == 0 && !adopted) {
            String name = "spark-" + sparkConf.get("spark.app.id", "app-" + System.currentTimeMillis());
            job = TernNative.startJob(client(), name, conf.jobLeaseMs);
            jobId = TernNative.jobId(job);
            LOG.info("Tern job {} holds this application's shuffles (lease {} ms)", jobId, conf.jobLeaseMs);
        }
        return jobId;
    }

    /** The token of the driver's job (its client keeps a fresher one as it renews). */
    private synchronized String jobToken() {
        jobId();
        return adopted ? TernNative.clientJobToken(client(), jobId) : TernNative.jobToken(job);
    }

    /** Gives this process's client the token a handle carries, once per token. */
    private void addToken(TernShuffleHandle<?, ?, ?> handle) {
        String token = handle.ternJobToken();
        if (token != null && !token.isEmpty() && tokens.add(token)) {
            TernNative.addJobToken(client(), token);
        }
    }

    /** The native handle of Tern shuffle {@code ternId}, opened once per process. */
    long shuffle(long ternId) {
        return shuffles.computeIfAbsent(ternId, id -> TernNative.openShuffle(client(), id));
    }

    @Override
    public <K, V, C> ShuffleHandle registerShuffle(int shuffleId, ShuffleDependency<K, V, C> dependency) {
        int partitions = Math.max(1, dependency.partitioner().numPartitions());
        int maps = dependency.rdd().getNumPartitions();
        serveEndpoint();
        startCleaner(dependency.rdd().context());
        long handle = TernNative.registerShuffle(
                client(), jobId(), partitions, maps, conf.storageClass, conf.splitSizeBytes, conf.copies);
        long ternId = TernNative.shuffleId(handle);
        shuffles.put(ternId, handle);
        ternIds.put(shuffleId, ternId);
        LOG.info("Spark shuffle {} is Tern shuffle {} ({} maps x {} partitions)", shuffleId, ternId, maps, partitions);
        return new TernShuffleHandle<>(shuffleId, dependency, ternId, partitions, jobToken());
    }

    /** On the driver, starts {@link TernDriverEndpoint} once (SparkEnv exists by the first shuffle). */
    private synchronized void serveEndpoint() {
        if (isDriver && endpoint == null && SparkEnv.get() != null) {
            endpoint = SparkEnv.get().rpcEnv().setupEndpoint(
                    TernDriverEndpoint.NAME, new TernDriverEndpoint(SparkEnv.get().rpcEnv(), this));
        }
    }

    /** On the driver, starts the {@link TernCleaner} once, listening to the application's events. */
    private synchronized void startCleaner(SparkContext context) {
        if (isDriver && cleaner == null && context != null) {
            sparkContext = context;
            cleaner = new TernCleaner(conf);
            context.addSparkListener(cleaner);
        }
    }

    /** The driver's endpoint, looked up once (executors). */
    private synchronized RpcEndpointRef driverEndpoint() {
        if (endpoint == null) {
            SparkEnv env = SparkEnv.get();
            endpoint = RpcUtils.makeDriverRef(TernDriverEndpoint.NAME, env.conf(), env.rpcEnv());
        }
        return endpoint;
    }

    /**
     * A push of this process waits for space ({@link TernNative#spaceWait}, on a native thread):
     * tells the driver, at most once a second per process, without waiting for an answer.
     */
    static void pushWaitsForSpace(String refusal) {
        SparkEnv env = SparkEnv.get();
        if (env == null || !(env.shuffleManager() instanceof TernShuffleManager)) {
            return;
        }
        long now = System.currentTimeMillis();
        long last = LAST_SPACE_REPORT_MS.get();
        if (now - last < SPACE_REPORT_INTERVAL_MS || !LAST_SPACE_REPORT_MS.compareAndSet(last, now)) {
            return;
        }
        TernShuffleManager manager = (TernShuffleManager) env.shuffleManager();
        try {
            if (manager.isDriver) {
                manager.freeUnreferencedShuffles(refusal);
            } else {
                manager.driverEndpoint().send(new TernDriverEndpoint.SpaceShort(refusal));
            }
        } catch (RuntimeException e) {
            LOG.warn("telling the driver that a push waits for space failed: {}", e.toString());
        }
    }

    /** Driver side: a push waits for space; has Spark free the shuffles nothing references. */
    void freeUnreferencedShuffles(String refusal) {
        TernCleaner c;
        synchronized (this) {
            c = cleaner;
        }
        if (c != null && c.collect("a push waits for space: " + refusal)) {
            LOG.warn("Tern is short of space for this application's shuffles; asked Spark to free the unreferenced "
                    + "ones: {}", refusal);
        }
    }

    /**
     * A map task found no space within {@code spark.tern.spaceWait}: the exception it fails with.
     * With a wait configured, the driver cancels the task's stage with a message saying what is
     * full and what to do, so Spark does not retry into the same wall; with none (0), the task
     * fails as any task does and Spark retries it.
     */
    RuntimeException outOfSpace(TaskContext task, TernOutOfSpaceException refused) {
        if (conf.spaceWaitMs <= 0) {
            return refused;
        }
        String message;
        try {
            message = isDriver
                    ? failStageForSpace(task.stageId(), refused.getMessage())
                    : driverEndpoint().askSync(new TernDriverEndpoint.SpaceExhausted(task.stageId(), refused.getMessage()),
                            ClassTag$.MODULE$.apply(String.class));
        } catch (RuntimeException e) {
            LOG.warn("asking the driver to cancel stage {} for want of space failed: {}", task.stageId(), e.toString());
            message = spaceAdvice(refused.getMessage(), -1, 0, task.stageId());
        }
        return new TernOutOfSpaceException("out-of-space", message);
    }

    /** Driver side: cancels {@code stageId} (once) for want of space; returns the message it fails with. */
    String failStageForSpace(int stageId, String refusal) {
        TernCleaner c;
        SparkContext context;
        synchronized (this) {
            c = cleaner;
            context = sparkContext;
        }
        String message = spaceAdvice(refusal, c == null ? -1 : c.heldBytes(), c == null ? 0 : c.heldShuffles(), stageId);
        if (stagesFailedForSpace.add(stageId) && context != null) {
            LOG.error("cancelling stage {}: {}", stageId, message);
            context.cancelStage(stageId, message);
        }
        return message;
    }

    /** What is full, what was tried, and what to do. {@code heldBytes} < 0: not known. */
    private String spaceAdvice(String refusal, long heldBytes, int heldShuffles, int stageId) {
        String held = heldBytes < 0 ? ""
                : "; the application still holds " + org.apache.spark.util.Utils.bytesToString(heldBytes)
                        + " of shuffle output in " + heldShuffles + " shuffle(s) Spark has not freed";
        String storageClass = conf.storageClass.isEmpty() ? "any" : conf.storageClass;
        String tiers = "any".equals(storageClass)
                ? "more storage servers, or more DRAM or NVMe on them"
                : "more storage servers, more " + storageClass.toUpperCase(java.util.Locale.ROOT)
                        + " on them, or spark.tern.storageClass=any (now " + storageClass
                        + ") so shuffles may use both DRAM and an NVMe tier";
        return "Tern has no room for this application's shuffle output: " + refusal
                + ". The map task waited " + conf.spaceWaitMs / 1000.0 + "s (spark.tern.spaceWait) while the driver had"
                + " Spark free the shuffles nothing references" + held + ". To fix: give Tern more room (" + tiers
                + "); let Spark free finished queries' shuffles (drop references to their DataFrames and RDDs,"
                + " run fewer shuffle-heavy queries per application, or lower spark.tern.cleanerThreshold); or wait"
                + " longer (spark.tern.spaceWait). Spark does not retry this task: stage " + stageId + " is cancelled";
    }

    /**
     * Called by a reader that found data of Spark shuffle {@code shuffleId} lost: has the driver
     * unregister every lost map output of the shuffle (all partitions, all maps) and returns their
     * map indexes. On the driver (local mode) it runs here; on an executor it asks the driver.
     */
    int[] reportLostMaps(int shuffleId) {
        if (isDriver) {
            return unregisterLostMaps(shuffleId);
        }
        return driverEndpoint().askSync(new TernDriverEndpoint.UnregisterLostMaps(shuffleId), ClassTag$.MODULE$.apply(int[].class));
    }

    /**
     * Driver side: asks Tern which maps of the shuffle have committed bytes on a lost server and
     * unregisters each one's output from the MapOutputTracker (only the output Spark holds now, by
     * its location), so the next map-stage attempt recomputes exactly those maps. Idempotent:
     * concurrent reports of the same loss unregister nothing twice.
     */
    int[] unregisterLostMaps(int shuffleId) {
        int[] lost = lostMaps(shuffleId);
        if (lost.length == 0) {
            return lost;
        }
        MapOutputTrackerMaster tracker = (MapOutputTrackerMaster) SparkEnv.get().mapOutputTracker();
        Option<ShuffleStatus> status = tracker.shuffleStatuses().get(shuffleId);
        int unregistered = 0;
        if (status.isDefined()) {
            MapStatus[] outputs = status.get().mapStatuses();
            for (int map : lost) {
                MapStatus output = map < outputs.length ? outputs[map] : null;
                if (output != null) {
                    tracker.unregisterMapOutput(shuffleId, map, output.location());
                    unregistered++;
                }
            }
        }
        LOG.warn("Tern lost the output of {} maps of Spark shuffle {} ({} still registered, now unregistered): {}",
                lost.length, shuffleId, unregistered, java.util.Arrays.toString(lost));
        return lost;
    }

    /** Driver side: the map indexes of Spark shuffle {@code shuffleId} whose committed output Tern lost. */
    public int[] lostMaps(int shuffleId) {
        Long ternId = ternIds.get(shuffleId);
        Long handle = ternId == null ? null : shuffles.get(ternId);
        if (handle == null) {
            return new int[0];
        }
        return TernNative.lostMaps(handle, 0, Integer.MAX_VALUE, 0, Integer.MAX_VALUE);
    }

    /** The Spark shuffle ids this process holds open (on the driver: those not yet unregistered). */
    public int[] registeredShuffles() {
        return ternIds.keySet().stream().mapToInt(Integer::intValue).sorted().toArray();
    }

    /** Driver side: garbage collections the plugin has run so Spark frees unreferenced shuffles. */
    public synchronized long cleanerCollections() {
        return cleaner == null ? 0 : cleaner.collections();
    }

    /** The id of the driver's Tern job ("" before the first shuffle). */
    public synchronized String ternJobId() {
        return jobId == null ? "" : jobId;
    }

    @Override
    public <K, V> ShuffleWriter<K, V> getWriter(
            ShuffleHandle handle, long mapId, TaskContext context, ShuffleWriteMetricsReporter metrics) {
        TernShuffleHandle<K, V, ?> tern = cast(handle);
        ternIds.putIfAbsent(tern.shuffleId(), tern.ternShuffleId());
        addToken(tern);
        return new TernShuffleWriter<>(this, tern, mapId, context, metrics);
    }

    @Override
    public <K, C> ShuffleReader<K, C> getReader(
            ShuffleHandle handle,
            int startMapIndex,
            int endMapIndex,
            int startPartition,
            int endPartition,
            TaskContext context,
            ShuffleReadMetricsReporter metrics) {
        TernShuffleHandle<K, ?, C> tern = cast(handle);
        ternIds.putIfAbsent(tern.shuffleId(), tern.ternShuffleId());
        addToken(tern);
        return new TernShuffleReader<>(
                this, tern, startMapIndex, endMapIndex, startPartition, endPartition, context, metrics);
    }

    @SuppressWarnings("unchecked")
    private static <K, V, C> TernShuffleHandle<K, V, C> cast(ShuffleHandle handle) {
        if (!(handle instanceof TernShuffleHandle)) {
            throw new IllegalArgumentException("not a Tern shuffle handle: " + handle
                    + " (is spark.shuffle.manager the same on the driver and the executors?)");
        }
        return (TernShuffleHandle<K, V, C>) handle;
    }

    /** On the driver, frees the shuffle's data in Tern; everywhere, closes the local handle. */
    @Override
    public boolean unregisterShuffle(int shuffleId) {
        Long ternId = ternIds.remove(shuffleId);
        if (ternId == null) {
            return true;
        }
        Long handle = shuffles.remove(ternId);
        if (handle == null) {
            return true;
        }
        try {
            if (isDriver) {
                TernNative.unregisterShuffle(handle);
                TernCleaner c;
                synchronized (this) {
                    c = cleaner;
                }
                if (c != null) {
                    c.shuffleUnregistered(shuffleId);
                }
            }
        } catch (TernException e) {
            LOG.warn("freeing Tern shuffle {} (Spark shuffle {}) failed; it goes with the job: {}",
                    ternId, shuffleId, e.getMessage());
        } finally {
            TernNative.closeShuffle(handle);
        }
        return true;
    }

    /**
     * ShuffleManager's method up to Spark 4.2, BlockingShuffleManager's from 4.3
     * ({@link TernBlockingShuffleManager}): no {@code @Override}, so one source compiles against both.
     */
    public ShuffleBlockResolver shuffleBlockResolver() {
        return resolver;
    }

    /** On the driver, ends the Tern job: every shuffle of the application is freed. */
    @Override
    public synchronized void stop() {
        if (stopped) {
            return;
        }
        stopped = true;
        if (isDriver && endpoint != null && SparkEnv.get() != null) {
            try {
                SparkEnv.get().rpcEnv().stop(endpoint);
            } catch (RuntimeException e) {
                LOG.debug("stopping the {} endpoint: {}", TernDriverEndpoint.NAME, e.toString());
            }
        }
        endpoint = null;
        if (cleaner != null) {
            cleaner.stop();
            cleaner = null;
        }
        for (Long handle : shuffles.values()) {
            TernNative.closeShuffle(handle);
        }
        shuffles.clear();
        ternIds.clear();
        if (job != 0) {
            try {
                TernNative.endJob(job);
                LOG.info("Tern job {} ended; its shuffles are freed", jobId);
            } catch (TernException e) {
                LOG.warn("ending Tern job {} failed; its lease will lapse: {}", jobId, e.getMessage());
            }
            job = 0;
        }
        if (client != 0) {
            TernNative.closeClient(client);
            client = 0;
        }
    }

    /** Spark never fetches Tern shuffle blocks through the block manager. */
    private static final class NoBlocks implements ShuffleBlockResolver {
        @Override
        public ManagedBuffer getBlockData(BlockId blockId, Option<String[]> dirs) {
            throw new UnsupportedOperationException("Tern shuffle blocks are read from Tern, not served: " + blockId);
        }

        // immutable.Seq: Scala 2.13's type, and a subtype of 2.12's collection.Seq, so it implements both.
        @Override
        public scala.collection.immutable.Seq<ManagedBuffer> getMergedBlockData(ShuffleMergedBlockId blockId, Option<String[]> dirs) {
            throw new UnsupportedOperationException("no push-based merged blocks with Tern: " + blockId);
        }

        @Override
        public MergedBlockMeta getMergedBlockMeta(ShuffleMergedBlockId blockId, Option<String[]> dirs) {
            throw new UnsupportedOperationException("no push-based merged blocks with Tern: " + blockId);
        }

        @Override
        public void stop() {}
    }
}

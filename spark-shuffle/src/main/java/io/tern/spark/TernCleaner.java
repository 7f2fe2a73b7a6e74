package io.tern.spark;

import java.util.Map;
import java.util.concurrent.ConcurrentHashMap;
import java.util.concurrent.ExecutorService;
import java.util.concurrent.Executors;
import java.util.concurrent.atomic.AtomicLong;
import java.util.concurrent.atomic.LongAdder;

import org.apache.spark.Success$;
import org.apache.spark.executor.TaskMetrics;
import org.apache.spark.scheduler.SparkListener;
import org.apache.spark.scheduler.SparkListenerStageSubmitted;
import org.apache.spark.scheduler.SparkListenerTaskEnd;
import org.apache.spark.scheduler.StageInfo;
import org.slf4j.Logger;
import org.slf4j.LoggerFactory;

import scala.Option;

/**
 * Driver side: has Spark free the shuffles nothing references any more, sooner than it would.
 *
 * <p>Spark unregisters a shuffle (and so frees it in Tern) only when its ContextCleaner sees the
 * shuffle's ShuffleDependency garbage-collected on the driver; a long application with a roomy
 * driver heap may not collect for a long time (Spark's own periodic GC runs every 30 minutes), so
 * the shuffles of finished queries pile up in Tern. This runs {@code System.gc()} on the driver,
 * at most once per {@code spark.tern.cleanerInterval}, when
 * <ul>
 *   <li>an executor's push waits for space (reported through {@link TernDriverEndpoint}), or
 *   <li>the shuffle bytes the application holds (map output written, counted from task ends, less
 *       the shuffles unregistered) pass {@code spark.tern.cleanerThreshold}, and at least that many
 *       bytes were written since the last collection (so live shuffles above the threshold do not
 *       cost a collection every interval).
 * </ul>
 * No call to Tern is needed: Spark's task-end events carry each map task's bytes written.
 */
final class TernCleaner extends SparkListener {
    private static final Logger LOG = LoggerFactory.getLogger(TernCleaner.class);

    private final long thresholdBytes;
    private final long intervalMs;
    /** Stage id -> the Spark shuffle its map tasks write. */
    private final Map<Integer, Integer> stageShuffles = new ConcurrentHashMap<>();
    /** Spark shuffle id -> bytes its map tasks wrote, while the shuffle is registered. */
    private final Map<Integer, LongAdder> shuffleBytes = new ConcurrentHashMap<>();
    private final AtomicLong writtenSinceCollection = new AtomicLong();
    /** When the last collection was started (ms since the epoch; 0: never). */
    private final AtomicLong lastCollectionMs = new AtomicLong();
    private final AtomicLong collections = new AtomicLong();
    private final ExecutorService collector = Executors.newSingleThreadExecutor(r -> {
        Thread thread = new Thread(r, "tern-cleaner");
        thread.setDaemon(true);
        return thread;
    });

    TernCleaner(TernConf conf) {
        this.thresholdBytes = conf.cleanerThresholdBytes;
        this.intervalMs = conf.cleanerIntervalMs;
    }

    @Override
    public void onStageSubmitted(SparkListenerStageSubmitted submitted) {
        StageInfo stage = submitted.stageInfo();
        Option<Object> shuffle = stage.shuffleDepId();
        if (shuffle.isDefined()) {
            stageShuffles.put(stage.stageId(), (Integer) shuffle.get());
        }
    }

    @Override
    public void onTaskEnd(SparkListenerTaskEnd end) {
        TaskMetrics metrics = end.taskMetrics();
        Integer shuffle = stageShuffles.get(end.stageId());
        if (shuffle == null || metrics == null || !(end.reason() instanceof Success$)) {
            return;
        }
        long bytes = metrics.shuffleWriteMetrics().bytesWritten();
        if (bytes <= 0) {
            return;
        }
        shuffleBytes.computeIfAbsent(shuffle, id -> new LongAdder()).add(bytes);
        long written = writtenSinceCollection.addAndGet(bytes);
        if (thresholdBytes > 0 && written >= thresholdBytes && heldBytes() >= thresholdBytes) {
            collect("the application's shuffles hold " + heldBytes() + " bytes, past spark.tern.cleanerThreshold="
                    + thresholdBytes);
        }
    }

    /** The shuffle was unregistered (its bytes freed in Tern): stop counting them. */
    void shuffleUnregistered(int shuffleId) {
        shuffleBytes.remove(shuffleId);
        stageShuffles.values().removeIf(id -> id == shuffleId);
    }

    /** Map output bytes of the shuffles Spark has not unregistered yet. */
    long heldBytes() {
        return shuffleBytes.values().stream().mapToLong(LongAdder::sum).sum();
    }

    /** How many shuffles with map output Spark has not unregistered yet. */
    int heldShuffles() {
        return shuffleBytes.size();
    }

    /**
     * Runs a garbage collection in the background unless one started less than the interval ago
     * (a push still waiting asks again at its next pause). Returns whether one was started.
     */
    boolean collect(String why) {
        long now = System.currentTimeMillis();
        long last = lastCollectionMs.get();
        if (now - last < intervalMs || !lastCollectionMs.compareAndSet(last, now)) {
            return false;
        }
        writtenSinceCollection.set(0);
        collections.incrementAndGet();
        long held = heldBytes();
        int shuffles = heldShuffles();
        collector.execute(() -> {
            long start = System.nanoTime();
            // Weakly reachable ShuffleDependencies are enqueued for Spark's ContextCleaner, whose
            // thread unregisters each shuffle: TernShuffleManager.unregisterShuffle frees it in Tern.
            System.gc();
            LOG.info("Tern: collected garbage on the driver in {} ms so Spark frees the shuffles nothing references "
                    + "({}; {} shuffles hold {} bytes)", (System.nanoTime() - start) / 1_000_000, why, shuffles, held);
        });
        return true;
    }

    /** Collections started so far. */
    long collections() {
        return collections.get();
    }

    void stop() {
        collector.shutdownNow();
    }
}

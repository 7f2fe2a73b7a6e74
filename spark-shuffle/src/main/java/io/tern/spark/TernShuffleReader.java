package io.tern.spark;

import java.io.InputStream;
import java.nio.ByteBuffer;
import java.util.HashMap;
import java.util.Map;

import org.apache.spark.Aggregator;
import org.apache.spark.InterruptibleIterator;
import org.apache.spark.ShuffleDependency;
import org.apache.spark.SparkEnv;
import org.apache.spark.TaskContext;
import org.apache.spark.serializer.SerializerInstance;
import org.apache.spark.serializer.SerializerManager;
import org.apache.spark.shuffle.FetchFailedException;
import org.apache.spark.shuffle.MetadataFetchFailedException;
import org.apache.spark.shuffle.ShuffleReadMetricsReporter;
import org.apache.spark.shuffle.ShuffleReader;
import org.apache.spark.storage.BlockId;
import org.apache.spark.storage.BlockManagerId;
import org.apache.spark.storage.ShuffleBlockId;
import org.apache.spark.util.collection.ExternalSorter;

import scala.Option;
import scala.Product2;
import scala.Tuple2;
import scala.Tuple3;
import scala.collection.AbstractIterator;
import scala.collection.Iterator;
import scala.collection.Seq;

/**
 * Reads partitions [startPartition, endPartition) of maps [startMapIndex, endMapIndex) from Tern:
 * only the map outputs the MapOutputTracker lists, and only if Tern's committed attempt of each is
 * the one the tracker names. Lost output has the driver unregister every lost map of the shuffle
 * (TernShuffleManager#reportLostMaps) and becomes a FetchFailedException naming one of them, so
 * Spark's one map-stage resubmission reruns exactly the lost maps; a mismatched attempt becomes a
 * FetchFailedException naming that map's own location. Then, as Spark's own reader does:
 * aggregation (ExternalAppendOnlyMap) and key ordering (ExternalSorter), both of which spill.
 */
final class TernShuffleReader<K, C> implements ShuffleReader<K, C> {
    private final TernShuffleManager manager;
    private final TernShuffleHandle<K, ?, C> handle;
    private final ShuffleDependency<K, ?, C> dep;
    private final int startMapIndex;
    private final int endMapIndex;
    private final int startPartition;
    private final int endPartition;
    private final TaskContext context;
    private final ShuffleReadMetricsReporter metrics;

    TernShuffleReader(
            TernShuffleManager manager,
            TernShuffleHandle<K, ?, C> handle,
            int startMapIndex,
            int endMapIndex,
            int startPartition,
            int endPartition,
            TaskContext context,
            ShuffleReadMetricsReporter metrics) {
        this.manager = manager;
        this.handle = handle;
        this.dep = handle.dependency();
        this.startMapIndex = startMapIndex;
        this.endMapIndex = endMapIndex;
        this.startPartition = startPartition;
        this.endPartition = endPartition;
        this.context = context;
        this.metrics = metrics;
    }

    /** The map output the tracker lists for one map index. */
    private static final class Listed {
        final long mapId;
        final BlockManagerId location;

        Listed(long mapId, BlockManagerId location) {
            this.mapId = mapId;
            this.location = location;
        }
    }

    @Override
    @SuppressWarnings({"unchecked", "rawtypes"})
    public Iterator<Product2<K, C>> read() {
        Map<Integer, Listed> listed = new HashMap<>();
        Iterator<Tuple2<BlockManagerId, Seq<Tuple3<BlockId, Object, Object>>>> byLocation = SparkEnv.get()
                .mapOutputTracker()
                .getMapSizesByExecutorId(handle.shuffleId(), startMapIndex, endMapIndex, startPartition, endPartition);
        while (byLocation.hasNext()) {
            Tuple2<BlockManagerId, Seq<Tuple3<BlockId, Object, Object>>> entry = byLocation.next();
            Iterator<Tuple3<BlockId, Object, Object>> blocks = entry._2().iterator();
            while (blocks.hasNext()) {
                Tuple3<BlockId, Object, Object> block = blocks.next();
                long mapId = ((ShuffleBlockId) block._1()).mapId();
                listed.putIfAbsent((Integer) block._3(), new Listed(mapId, entry._1()));
            }
        }
        Records records = new Records(listed);
        context.addTaskCompletionListener((org.apache.spark.util.TaskCompletionListener) ctx -> records.close());
        Iterator<Product2<K, Object>> input = (Iterator) records;
        Iterator<Product2<K, C>> combined;
        if (dep.aggregator().isDefined()) {
            Aggregator<K, Object, C> aggregator = (Aggregator<K, Object, C>) dep.aggregator().get();
            combined = dep.mapSideCombine()
                    ? (Iterator) aggregator.combineCombinersByKey((Iterator) input, context)
                    : (Iterator) aggregator.combineValuesByKey(input, context);
        } else {
            combined = (Iterator) input;
        }
        if (dep.keyOrdering().isDefined()) {
            ExternalSorter<K, C, C> sorter = SparkLine.sorter(context, (Option) dep.keyOrdering(), dep.serializer());
            sorter.insertAll(combined);
            context.taskMetrics().incMemoryBytesSpilled(sorter.memoryBytesSpilled());
            context.taskMetrics().incDiskBytesSpilled(sorter.diskBytesSpilled());
            context.taskMetrics().incPeakExecutionMemory(sorter.peakMemoryUsedBytes());
            context.addTaskCompletionListener((org.apache.spark.util.TaskCompletionListener) ctx -> sorter.stop());
            combined = new Completing<>(sorter.iterator(), sorter::stop);
        }
        return new InterruptibleIterator<>(context, combined);
    }

    /** An iterator that runs {@code done} once, when it is exhausted. */
    private static final class Completing<T> extends AbstractIterator<T> {
        private final Iterator<T> inner;
        private Runnable done;

        Completing(Iterator<T> inner, Runnable done) {
            this.inner = inner;
            this.done = done;
        }

        @Override
        public boolean hasNext() {
            boolean more = inner.hasNext();
            if (!more && done != null) {
                Runnable d = done;
                done = null;
                d.run();
            }
            return more;
        }

        @Override
        public T next() {
            return inner.next();
        }
    }

    /** The records of every listed map's chunks, batch by batch, chunk by chunk. */
    private final class Records extends AbstractIterator<Product2<Object, Object>> {
        private final Map<Integer, Listed> listed;
        private final SerializerManager serializerManager = SparkEnv.get().serializerManager();
        private final SerializerInstance serializer = dep.serializer().newInstance();
        private final int[] meta = new int[2];
        /** Bytes of a chunk cut across batches, per (partition, map). */
        private final Map<Long, byte[]> carried = new HashMap<>();
        private long shuffle;
        private long reader;
        private boolean opened;
        private boolean finished;
        private ByteBuffer batch;
        private int batchPartition;
        private int batchMap;
        private Iterator<Tuple2<Object, Object>> chunk;

        Records(Map<Integer, Listed> listed) {
            this.listed = listed;
        }

        @Override
        public boolean hasNext() {
            while (true) {
                if (chunk != null && chunk.hasNext()) {
                    return true;
                }
                chunk = null;
                if (finished) {
                    return false;
                }
                if (batch != null && nextChunk()) {
                    continue;
                }
                if (!nextBatch()) {
                    close();
                    context.taskMetrics().mergeShuffleReadMetrics();
                    return false;
                }
            }
        }

        @Override
        public Product2<Object, Object> next() {
            if (!hasNext()) {
                throw new java.util.NoSuchElementException();
            }
            metrics.incRecordsRead(1);
            return chunk.next();
        }

        private void open() {
            shuffle = manager.shuffle(handle.ternShuffleId());
            int endMap = endMapIndex;
            try {
                reader = TernNative.openReader(shuffle, startPartition, endPartition, startMapIndex, endMap);
            } catch (TernException e) {
                throw fetchFailed(e);
            }
            long[] commits = TernNative.readerCommits(reader);
            Map<Integer, Long> committed = new HashMap<>();
            for (int i = 0; i + 1 < commits.length; i += 2) {
                committed.put((int) commits[i], commits[i + 1]);
            }
            for (Map.Entry<Integer, Listed> e : listed.entrySet()) {
                Long attempt = committed.get(e.getKey());
                long expected = e.getValue().mapId & 0xffffffffL;
                if (attempt == null || attempt != expected) {
                    throw sneaky(failure(e.getKey(), e.getValue(), "Tern holds "
                            + (attempt == null ? "no committed output" : "attempt " + attempt)
                            + " of map " + e.getKey() + ", Spark expects attempt " + expected, null));
                }
            }
            opened = true;
        }

        /** Moves to the next batch of a listed map; false at the end. */
        private boolean nextBatch() {
            if (!opened) {
                open();
            }
            while (true) {
                long start = System.nanoTime();
                ByteBuffer next;
                try {
                    next = TernNative.nextBatch(reader, meta);
                } catch (TernException e) {
                    throw fetchFailed(e);
                }
                metrics.incFetchWaitTime((System.nanoTime() - start) / 1_000_000);
                if (next == null) {
                    batch = null;
                    finished = true;
                    return false;
                }
                metrics.incRemoteBytesRead(next.remaining());
                metrics.incRemoteBlocksFetched(1);
                if (!listed.containsKey(meta[1])) {
                    continue; // not an output Spark asked for (no bytes in range by its record)
                }
                batchPartition = meta[0];
                batchMap = meta[1];
                byte[] carry = carried.remove(key(batchPartition, batchMap));
                if (carry != null) {
                    ByteBuffer joined = ByteBuffer.allocate(carry.length + next.remaining());
                    joined.put(carry).put(next).flip();
                    next = joined;
                }
                batch = next;
                return true;
            }
        }

        /** Opens the next whole chunk of the batch; keeps a cut one for the map's next batch. */
        private boolean nextChunk() {
            ByteBuffer b = batch;
            if (b.remaining() >= 4) {
                int length = b.getInt(b.position());
                if (length < 0) {
                    throw new TernException("corrupt", "negative chunk length in shuffle " + handle.shuffleId());
                }
                if (b.remaining() - 4 >= length) {
                    ByteBuffer slice = b.slice();
                    slice.position(4).limit(4 + length);
                    b.position(b.position() + 4 + length);
                    BlockId block = new ShuffleBlockId(handle.shuffleId(), batchMap, batchPartition);
                    InputStream in = serializerManager.wrapStream(block, new BufferInput(slice.slice()));
                    chunk = serializer.deserializeStream(in).asKeyValueIterator();
                    return true;
                }
            }
            if (b.hasRemaining()) {
                byte[] rest = new byte[b.remaining()];
                b.get(rest);
                carried.put(key(batchPartition, batchMap), rest);
            }
            batch = null;
            return false;
        }

        private long key(int partition, int map) {
            return ((long) partition << 32) | (map & 0xffffffffL);
        }

        /**
         * A data-lost error as a fetch failure. First the driver unregisters every lost map output
         * of the shuffle (not only this reader's), so the stage's one resubmission recomputes all
         * of them; then the failure names one lost map this reader was given (its own location),
         * or, if none, is a metadata fetch failure, which only makes Spark resubmit. Other errors
         * are rethrown as they are.
         */
        private RuntimeException fetchFailed(TernException e) {
            if (!e.isDataLost()) {
                return e;
            }
            int[] lost;
            try {
                lost = manager.reportLostMaps(handle.shuffleId());
            } catch (RuntimeException report) {
                e.addSuppressed(report);
                return e;
            }
            if (lost.length == 0) {
                return e;
            }
            String message = "Tern lost the output of maps " + java.util.Arrays.toString(lost) + " of shuffle "
                    + handle.shuffleId() + " (unregistered for recomputation): " + e.getMessage();
            for (int map : lost) {
                if (listed.containsKey(map)) {
                    return sneaky(failure(map, listed.get(map), message, e));
                }
            }
            close();
            return sneaky(new MetadataFetchFailedException(handle.shuffleId(), startPartition, message));
        }

        private FetchFailedException failure(int mapIndex, Listed output, String message, Throwable cause) {
            close();
            return new FetchFailedException(
                    output.location, handle.shuffleId(), output.mapId, mapIndex, startPartition, message, cause);
        }

        void close() {
            batch = null;
            chunk = null;
            if (reader != 0) {
                long r = reader;
                reader = 0;
                TernNative.closeReader(r);
            }
        }
    }

    @SuppressWarnings("unchecked")
    private static <E extends Throwable> RuntimeException sneaky(Throwable e) throws E {
        throw (E) e;
    }

    /** Reads a ByteBuffer (direct or heap) in place. */
    private static final class BufferInput extends InputStream {
        private final ByteBuffer buffer;

        BufferInput(ByteBuffer buffer) {
            this.buffer = buffer;
        }

        @Override
        public int read() {
            return buffer.hasRemaining() ? buffer.get() & 0xff : -1;
        }

        @Override
        public int read(byte[] b, int off, int len) {
            if (len == 0) {
                return 0;
            }
            if (!buffer.hasRemaining()) {
                return -1;
            }
            int n = Math.min(len, buffer.remaining());
            buffer.get(b, off, n);
            return n;
        }

        @Override
        public long skip(long n) {
            int k = (int) Math.max(0, Math.min(n, buffer.remaining()));
            buffer.position(buffer.position() + k);
            return k;
        }

        @Override
        public int available() {
            return buffer.remaining();
        }
    }
}

package io.tern.spark;

import java.io.IOException;
import java.io.OutputStream;
import java.nio.ByteBuffer;
import java.util.Arrays;

import org.apache.spark.Partitioner;
import org.apache.spark.ShuffleDependency;
import org.apache.spark.SparkEnv;
import org.apache.spark.TaskContext;
import org.apache.spark.scheduler.MapStatus;
import org.apache.spark.serializer.SerializationStream;
import org.apache.spark.serializer.SerializerInstance;
import org.apache.spark.serializer.SerializerManager;
import org.apache.spark.shuffle.ShuffleWriteMetricsReporter;
import org.apache.spark.shuffle.ShuffleWriter;
import org.apache.spark.storage.BlockManagerId;
import org.apache.spark.storage.BlockManagerId$;
import org.apache.spark.storage.ShuffleBlockId;

import scala.Option;
import scala.Product2;
import scala.reflect.ClassTag;
import scala.reflect.ClassTag$;

/**
 * Writes one map task's output to Tern as map index = the task's partition, attempt = its task
 * attempt id. Records (combined first when the dependency asks for map-side combine) are
 * serialized with the dependency's serializer and Spark's compression codec into one buffer per
 * partition; a full buffer becomes a chunk {@code [int length][self-contained stream]} handed to
 * the native writer in place (direct buffer), which batches and pushes it. The commit makes this
 * attempt the map's output unless another attempt committed first; then the winner is reported.
 * Where Spark asks for order-independent row checksums (4.1 on, {@link RowChecksums}) every record
 * written feeds them, after map-side combine where there is one (Spark's sorter checksums before;
 * SQL, the only user, never combines map-side), and the MapStatus carries their value.
 */
final class TernShuffleWriter<K, V, C> extends ShuffleWriter<K, V> {
    private static final ClassTag<Object> ANY = ClassTag$.MODULE$.Any();

    private final TernShuffleManager manager;
    private final TernShuffleHandle<K, V, C> handle;
    private final ShuffleDependency<K, V, C> dep;
    private final long mapId;
    private final TaskContext context;
    private final ShuffleWriteMetricsReporter metrics;
    private final TernConf conf;
    private final SerializerManager serializerManager = SparkEnv.get().serializerManager();
    private final SerializerInstance serializer;
    private final int partitions;
    private final long[] lengths;
    private final Chunk[] chunks;
    /** Spark's row checksums of this map's records, where the running Spark asks for them (else null). */
    private final RowChecksums checksums;
    private ByteBuffer staging = ByteBuffer.allocateDirect(64 << 10);
    private long buffered;
    private long writer;
    private MapStatus status;

    @SuppressWarnings("unchecked")
    TernShuffleWriter(
            TernShuffleManager manager,
            TernShuffleHandle<K, V, C> handle,
            long mapId,
            TaskContext context,
            ShuffleWriteMetricsReporter metrics) {
        this.manager = manager;
        this.handle = handle;
        this.dep = handle.dependency();
        this.mapId = mapId;
        this.context = context;
        this.metrics = metrics;
        this.conf = manager.conf();
        this.serializer = dep.serializer().newInstance();
        this.partitions = handle.ternPartitions();
        this.lengths = new long[partitions];
        this.chunks = (Chunk[]) java.lang.reflect.Array.newInstance(Chunk.class, partitions);
        this.checksums = SparkLine.rowChecksums(dep);
    }

    @Override
    public void write(scala.collection.Iterator<Product2<K, V>> records) throws IOException {
        try {
            writeAll(records);
        } catch (TernOutOfSpaceException refused) {
            // The native writer waited spark.tern.spaceWait for room already.
            throw manager.outOfSpace(context, refused);
        }
    }

    @SuppressWarnings({"unchecked", "rawtypes"})
    private void writeAll(scala.collection.Iterator<Product2<K, V>> records) throws IOException {
        int mapIndex = context.partitionId();
        long shuffle = manager.shuffle(handle.ternShuffleId());
        long start = System.nanoTime();
        if (context.stageAttemptNumber() > 0 || context.attemptNumber() > 0) {
            // A rerun, maybe because this map's committed output was lost: forget that commit so
            // this attempt's can win. A commit whose data is intact stays, and wins.
            int[] lost = TernNative.lostMaps(shuffle, 0, partitions, mapIndex, mapIndex + 1);
            if (lost.length > 0) {
                TernNative.invalidateMaps(shuffle, lost);
            }
        }
        writer = TernNative.openWriter(
                shuffle, mapIndex, (int) mapId, conf.pushBufferBytes, conf.pushBatchBytes, conf.pushesInFlight,
                conf.spaceWaitMs);
        long nativeNanos = System.nanoTime() - start;
        scala.collection.Iterator<? extends Product2<K, ?>> input = dep.mapSideCombine()
                ? (scala.collection.Iterator) dep.aggregator().get().combineValuesByKey(records, context)
                : records;
        Partitioner partitioner = dep.partitioner();
        long count = 0;
        while (input.hasNext()) {
            Product2<K, ?> record = input.next();
            int p = partitioner.getPartition(record._1());
            if (checksums != null) {
                checksums.update(p, record._1(), record._2());
            }
            Chunk chunk = chunks[p];
            if (chunk == null) {
                chunk = chunks[p] = new Chunk(p);
            }
            long before = chunk.out.size;
            chunk.stream.writeKey(record._1(), ANY);
            chunk.stream.writeValue(record._2(), ANY);
            buffered += chunk.out.size - before;
            count++;
            if (chunk.out.size >= conf.chunkBytes) {
                nativeNanos += flush(chunk, true);
            } else if (buffered > conf.writeBufferBytes) {
                nativeNanos += flushLargest();
            }
        }
        for (Chunk chunk : chunks) {
            if (chunk != null) {
                nativeNanos += flush(chunk, false);
            }
        }
        long committing = System.nanoTime();
        long outcome = TernNative.commit(writer);
        nativeNanos += System.nanoTime() - committing;
        boolean won = (outcome >>> 32) != 0;
        long winner = outcome & 0xffffffffL;
        metrics.incRecordsWritten(count);
        metrics.incWriteTime(nativeNanos);
        // The map's output is the winner's: a losing attempt reports the winner's id and location,
        // so whichever report Spark keeps, readers look for the attempt Tern holds.
        // Its row checksum, though, is its own records': Tern keeps no checksum with a commit, so
        // where two attempts of a nondeterministic map both finish (speculation), Spark may keep
        // the loser's checksum for the winner's data and compare a later rerun with that.
        long outputId = won ? mapId : winner;
        BlockManagerId self = SparkEnv.get().blockManager().blockManagerId();
        BlockManagerId location = BlockManagerId$.MODULE$.apply(
                "tern-" + outputId, self.host(), self.port(), Option.<String>empty());
        status = SparkLine.mapStatus(location, lengths, outputId, checksums == null ? 0 : checksums.value());
    }

    /** Closes the partition's stream (flushing its codec) and hands the chunk to the native writer. */
    private long flush(Chunk chunk, boolean reopen) throws IOException {
        chunk.stream.close();
        Bytes out = chunk.out;
        if (out.size > 0) {
            int frame = 4 + out.size;
            if (staging.capacity() < frame) {
                staging = ByteBuffer.allocateDirect(Math.max(frame, staging.capacity() * 2));
            }
            staging.clear();
            staging.putInt(out.size).put(out.buf, 0, out.size);
            long start = System.nanoTime();
            TernNative.write(writer, chunk.partition, staging, 0, frame);
            long nanos = System.nanoTime() - start;
            lengths[chunk.partition] += frame;
            metrics.incBytesWritten(frame);
            buffered = Math.max(0, buffered - out.size);
            out.size = 0;
            if (reopen) {
                chunk.open();
            }
            return nanos;
        }
        if (reopen) {
            chunk.open();
        }
        return 0;
    }

    private long flushLargest() throws IOException {
        Chunk largest = null;
        for (Chunk chunk : chunks) {
            if (chunk != null && (largest == null || chunk.out.size > largest.out.size)) {
                largest = chunk;
            }
        }
        return largest == null ? 0 : flush(largest, true);
    }

    @Override
    public Option<MapStatus> stop(boolean success) {
        long w = writer;
        writer = 0;
        TernNative.closeWriter(w);
        return success && status != null ? Option.apply(status) : Option.<MapStatus>empty();
    }

    @Override
    public long[] getPartitionLengths() {
        return Arrays.copyOf(lengths, lengths.length);
    }

    /** One partition's open serialization stream over its bytes. */
    private final class Chunk {
        final int partition;
        final Bytes out = new Bytes();
        SerializationStream stream;

        Chunk(int partition) {
            this.partition = partition;
            open();
        }

        void open() {
            ShuffleBlockId block = new ShuffleBlockId(dep.shuffleId(), mapId, partition);
            stream = serializer.serializeStream(serializerManager.wrapStream(block, out));
        }
    }

    /** An unsynchronized growable byte array; close() is a no-op so streams over it can end. */
    static final class Bytes extends OutputStream {
        byte[] buf = new byte[4096];
        int size;

        @Override
        public void write(int b) {
            if (size == buf.length) {
                grow(size + 1);
            }
            buf[size++] = (byte) b;
        }

        @Override
        public void write(byte[] b, int off, int len) {
            if (size + len > buf.length) {
                grow(size + len);
            }
            System.arraycopy(b, off, buf, size, len);
            size += len;
        }

        private void grow(int needed) {
            buf = Arrays.copyOf(buf, Math.max(needed, buf.length * 2));
        }

        @Override
        public void close() {}
    }
}

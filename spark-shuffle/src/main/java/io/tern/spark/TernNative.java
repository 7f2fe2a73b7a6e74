package io.tern.spark;

import java.nio.ByteBuffer;

/**
 * The JNI bridge to libtern_spark (spark-shuffle/src/lib.rs). Every {@code long} is an opaque
 * native handle, freed by its {@code close*} call exactly once; data moves through direct
 * ByteBuffers. Every failure is thrown as a {@link TernException}.
 *
 * <p>The library is loaded by {@link NativeLibrary}: from java.library.path, or the copy for
 * this platform bundled in the jar, so users need no library-path setting.
 */
public final class TernNative {
    private TernNative() {}

    static {
        // The shuffle manager loads it first with its Spark conf's directory; this covers other
        // callers.
        NativeLibrary.load(null);
    }

    /**
     * Connects to the metadata server; empty strings mean unset: transport "auto", no TLS
     * material (tlsDir, or all three PEM texts), the credential's tenant (else the default one),
     * no credential (a client of the default tenant).
     */
    public static native long connect(
            String metadataAddr,
            String transport,
            String tlsDir,
            String caPem,
            String certPem,
            String secretKeyPem,
            String tenant,
            String credentialFile);

    public static native void closeClient(long client);

    public static native long startJob(long client, String name, long leaseMs);

    public static native String jobId(long job);

    /** The job's token (text form), for the shuffle handles sent to executors. */
    public static native String jobToken(long job);

    /** Gives the client a job's token: pushes and fetches of the job's shuffles need it. */
    public static native void addJobToken(long client, String token);

    /** The freshest token the client holds for {@code jobId} (it refreshes the ones it was given). */
    public static native String clientJobToken(long client, String jobId);

    /** Ends the job, freeing all its data, and frees the handle. */
    public static native void endJob(long job);

    /** Stops renewing the job's lease (as a crashed driver would) and frees the handle. */
    public static native void abandonJob(long job);

    public static native long registerShuffle(
            long client,
            String jobId,
            int partitions,
            int maps,
            String storageClass,
            long splitSizeBytes,
            int copies);

    public static native long openShuffle(long client, long ternShuffleId);

    public static native long shuffleId(long shuffle);

    public static native void unregisterShuffle(long shuffle);

    public static native void closeShuffle(long shuffle);

    public static native int[] lostMaps(long shuffle, int startPartition, int endPartition, int startMap, int endMap);

    public static native int invalidateMaps(long shuffle, int[] maps);

    /**
     * A map attempt's writer. A push refused for space waits up to {@code spaceWaitMs} for room
     * (calling {@link #spaceWait} at each pause) before failing with TernOutOfSpaceException.
     */
    public static native long openWriter(
            long shuffle, int map, int attempt, long bufferBytes, int batchBytes, int pushesInFlight,
            long spaceWaitMs);

    /**
     * Called by the native library, on one of its own threads, each time a push refused for space
     * pauses before trying again: {@code refusal} says which segment, server and tiers are full.
     * Must not block (it only sends a message).
     */
    static void spaceWait(String refusal) {
        TernShuffleManager.pushWaitsForSpace(refusal);
    }

    /** Appends bytes [offset, offset+length) of a direct buffer to a partition. */
    public static native void write(long writer, int partition, ByteBuffer data, int offset, int length);

    /** Commits; bit 32 set if this attempt won, low 32 bits the winning attempt. */
    public static native long commit(long writer);

    public static native void closeWriter(long writer);

    public static native long openReader(long shuffle, int startPartition, int endPartition, int startMap, int endMap);

    /** [map index, attempt, ...] of the committed maps the reader covers. */
    public static native long[] readerCommits(long reader);

    /** The next batch (valid until the next call), meta = {partition, map}; null at the end. */
    public static native ByteBuffer nextBatch(long reader, int[] meta);

    public static native void closeReader(long reader);
}

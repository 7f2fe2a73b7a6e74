package io.tern.spark;

import org.apache.spark.SparkConf;

/** The plugin's settings, read from the SparkConf (documented in the repository's README). */
final class TernConf {
    /** Metadata server, host:port. Required. */
    static final String METADATA = "spark.tern.metadata";
    /** Block transport: "auto", "tcp", "tls", "quic", "local" or "rdma". */
    static final String TRANSPORT = "spark.tern.transport";
    /** A TLS directory made by `tern cert init` (ca.pem, node.pem, node.key), on every host. */
    static final String TLS_DIR = "spark.tern.tlsDir";
    /** The same material as PEM text in the configuration, for hosts without the files. */
    static final String TLS_CA = "spark.tern.tls.ca";
    static final String TLS_CERT = "spark.tern.tls.cert";
    /** Named "secret" so that Spark's default spark.redaction.regex hides it in the UI and logs. */
    static final String TLS_SECRET_KEY = "spark.tern.tls.secretKey";
    /** The tenant the application's Tern job counts against (quotas, fair share). */
    static final String TENANT = "spark.tern.tenant";
    /**
     * A credential file (`tern cert credential --role client --tenant NAME`) the driver acts with
     * on the control plane: a client of its tenant, which a tenant other than the default needs.
     * Unset: a client of the default tenant.
     */
    static final String CREDENTIAL_FILE = "spark.tern.credentialFile";
    /** Copies of each shuffle segment, on different storage servers: 1 or 2. */
    static final String COPIES = "spark.tern.copies";
    /** "dram", "nvme" or "any". */
    static final String STORAGE_CLASS = "spark.tern.storageClass";
    /** Bytes after which a partition continues on another server (0: the cluster's default). */
    static final String SPLIT_SIZE = "spark.tern.splitSize";
    /** Lease of the driver's Tern job: a crashed driver's data is freed this long after it dies. */
    static final String JOB_LEASE = "spark.tern.jobLease";
    /** Serialized bytes a partition gathers before they go to the native writer as one chunk. */
    static final String CHUNK_SIZE = "spark.tern.write.chunkSize";
    /** Serialized bytes a map task holds across partitions before flushing the largest. */
    static final String WRITE_BUFFER = "spark.tern.write.bufferSize";
    /** Bytes the native writer buffers across partitions before pushing. */
    static final String PUSH_BUFFER = "spark.tern.push.bufferSize";
    /** Largest batch the native writer pushes (capped by the cluster's block size). */
    static final String PUSH_BATCH = "spark.tern.push.batchSize";
    /** Pushes a map task has in flight at once. */
    static final String PUSHES_IN_FLIGHT = "spark.tern.push.inFlight";
    /** How long a map task's push refused for space waits for room before the task fails (0: no wait). */
    static final String SPACE_WAIT = "spark.tern.spaceWait";
    /** Shuffle bytes the application may hold before the driver has Spark free unreferenced ones (0: never). */
    static final String CLEANER_THRESHOLD = "spark.tern.cleanerThreshold";
    /** Least time between two garbage collections the plugin runs on the driver. */
    static final String CLEANER_INTERVAL = "spark.tern.cleanerInterval";
    /** Where the native library is unpacked (a directory that allows executing files). */
    static final String NATIVE_DIR = "spark.tern.nativeDir";

    final String metadata;
    final String transport;
    final String tlsDir;
    final String tlsCa;
    final String tlsCert;
    final String tlsSecretKey;
    final String tenant;
    final String credentialFile;
    final int copies;
    final String storageClass;
    final long splitSizeBytes;
    final long jobLeaseMs;
    final int chunkBytes;
    final long writeBufferBytes;
    final long pushBufferBytes;
    final int pushBatchBytes;
    final int pushesInFlight;
    final long spaceWaitMs;
    final long cleanerThresholdBytes;
    final long cleanerIntervalMs;

    TernConf(SparkConf conf) {
        metadata = conf.get(METADATA, "");
        transport = conf.get(TRANSPORT, "auto");
        tlsDir = conf.get(TLS_DIR, "");
        tlsCa = conf.get(TLS_CA, "");
        tlsCert = conf.get(TLS_CERT, "");
        tlsSecretKey = conf.get(TLS_SECRET_KEY, "");
        tenant = conf.get(TENANT, "");
        credentialFile = conf.get(CREDENTIAL_FILE, "");
        copies = conf.getInt(COPIES, 1);
        if (copies < 1 || copies > 2) {
            throw new IllegalArgumentException(COPIES + " is " + copies + ": Tern keeps 1 or 2 copies of a shuffle segment");
        }
        storageClass = conf.get(STORAGE_CLASS, "");
        splitSizeBytes = conf.getSizeAsBytes(SPLIT_SIZE, "0");
        jobLeaseMs = conf.getTimeAsMs(JOB_LEASE, "30s");
        chunkBytes = (int) Math.min(conf.getSizeAsBytes(CHUNK_SIZE, "256k"), 64L << 20);
        writeBufferBytes = conf.getSizeAsBytes(WRITE_BUFFER, "32m");
        pushBufferBytes = conf.getSizeAsBytes(PUSH_BUFFER, "16m");
        pushBatchBytes = (int) Math.min(conf.getSizeAsBytes(PUSH_BATCH, "1m"), 1L << 30);
        pushesInFlight = conf.getInt(PUSHES_IN_FLIGHT, 16);
        spaceWaitMs = conf.getTimeAsMs(SPACE_WAIT, "60s");
        cleanerThresholdBytes = conf.getSizeAsBytes(CLEANER_THRESHOLD, "1g");
        cleanerIntervalMs = conf.getTimeAsMs(CLEANER_INTERVAL, "5s");
    }

    /**
     * Where to unpack the native library: {@code spark.tern.nativeDir}, else Spark's first local
     * directory (spark.local.dir, SPARK_LOCAL_DIRS, or the cluster manager's), never assuming
     * /tmp may hold executable files; null where neither is known.
     */
    static String nativeDir(SparkConf conf) {
        String dir = conf.get(NATIVE_DIR, "");
        if (!dir.isEmpty()) {
            return dir;
        }
        try {
            String[] local = org.apache.spark.util.Utils.getConfiguredLocalDirs(conf);
            return local.length > 0 ? local[0] : null;
        } catch (LinkageError notThisSpark) {
            return null;
        }
    }

    String requireMetadata() {
        if (metadata.isEmpty()) {
            throw new IllegalArgumentException(METADATA + " is not set: give the Tern metadata server's host:port");
        }
        return metadata;
    }
}

package io.tern.spark;

import org.apache.spark.ShuffleDependency;
import org.apache.spark.shuffle.BaseShuffleHandle;

/**
 * Spark's handle for a shuffle, plus the id Tern gave it (what executors open it by) and the
 * token of the Tern job owning it (what their pushes and fetches act under; refreshed by the
 * executors' clients while the driver renews the job's lease).
 */
public class TernShuffleHandle<K, V, C> extends BaseShuffleHandle<K, V, C> {
    private static final long serialVersionUID = 1L;
    private final long ternShuffleId;
    private final int ternPartitions;
    private final String ternJobToken;

    public TernShuffleHandle(
            int shuffleId,
            ShuffleDependency<K, V, C> dependency,
            long ternShuffleId,
            int ternPartitions,
            String ternJobToken) {
        super(shuffleId, dependency);
        this.ternShuffleId = ternShuffleId;
        this.ternPartitions = ternPartitions;
        this.ternJobToken = ternJobToken;
    }

    public String ternJobToken() {
        return ternJobToken;
    }

    public long ternShuffleId() {
        return ternShuffleId;
    }

    /** Partitions as registered with Tern (at least 1, even for a 0-partition dependency). */
    public int ternPartitions() {
        return ternPartitions;
    }
}

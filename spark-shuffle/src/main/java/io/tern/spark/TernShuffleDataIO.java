package io.tern.spark;

import java.util.Collections;
import java.util.Map;

import org.apache.spark.SparkConf;
import org.apache.spark.SparkEnv;
import org.apache.spark.shuffle.api.ShuffleDataIO;
import org.apache.spark.shuffle.api.ShuffleDriverComponents;
import org.apache.spark.shuffle.api.ShuffleExecutorComponents;
import org.apache.spark.shuffle.sort.io.LocalDiskShuffleExecutorComponents;

/**
 * Set as {@code spark.shuffle.sort.io.plugin.class}: its driver components declare reliable
 * storage, since map outputs live in Tern, not on executors. Spark then keeps map outputs when an
 * executor is lost and lets dynamic allocation run without an external shuffle service; its
 * removeShuffle carries Spark's shuffle cleanup to every TernShuffleManager. The
 * executor components are Spark's local-disk ones, which TernShuffleManager never calls.
 */
public class TernShuffleDataIO implements ShuffleDataIO {
    private final SparkConf conf;

    public TernShuffleDataIO(SparkConf conf) {
        SparkLine.requireSupported();
        this.conf = conf;
    }

    @Override
    public ShuffleExecutorComponents executor() {
        return new LocalDiskShuffleExecutorComponents(conf);
    }

    @Override
    public ShuffleDriverComponents driver() {
        return new ShuffleDriverComponents() {
            @Override
            public Map<String, String> initializeApplication() {
                return Collections.emptyMap();
            }

            @Override
            public void cleanupApplication() {}

            @Override
            public boolean supportsReliableStorage() {
                return true;
            }

            /**
             * Spark's ContextCleaner frees a shuffle only through this call (the default does
             * nothing): send RemoveShuffle to every block manager, as the local-disk components
             * do, so each process's TernShuffleManager.unregisterShuffle runs; the driver's frees
             * the shuffle's data in Tern.
             */
            @Override
            public void removeShuffle(int shuffleId, boolean blocking) {
                SparkEnv env = SparkEnv.get();
                if (env != null) {
                    env.blockManager().master().removeShuffle(shuffleId, blocking);
                }
            }
        };
    }
}

package io.tern.spark;

import org.apache.spark.SparkConf;
import org.apache.spark.shuffle.BlockingShuffleManager;

/**
 * Tern's shuffle manager on Spark 4.3 and later
 * ({@code spark.shuffle.manager=io.tern.spark.TernBlockingShuffleManager}): 4.3 splits
 * ShuffleManager into blocking managers (materialized shuffles whose blocks resolve by id) and
 * pipelined ones, and takes only a BlockingShuffleManager as {@code spark.shuffle.manager}.
 * Tern's is a blocking one; everything is {@link TernShuffleManager}'s, whose
 * {@code shuffleBlockResolver()} is this interface's method. 4.0 to 4.2 lack the interface, so
 * they cannot load this class and take TernShuffleManager itself.
 */
public class TernBlockingShuffleManager extends TernShuffleManager implements BlockingShuffleManager {
    public TernBlockingShuffleManager(SparkConf conf, boolean isDriver) {
        super(conf, isDriver);
    }
}

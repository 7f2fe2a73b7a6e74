package io.tern.spark;

import org.apache.spark.ShuffleDependency;
import org.apache.spark.shuffle.checksum.RowBasedChecksum;

/**
 * Spark 4.1+'s row checksums of a map task ({@code ShuffleDependency.rowBasedChecksums}, one per
 * reduce partition, fresh in each task's deserialized dependency) fed as Spark's ExternalSorter
 * feeds them. A class of its own so that Spark 4.0, which lacks RowBasedChecksum, never loads it
 * ({@link SparkLine#rowChecksums} calls it only where the API exists).
 */
final class SparkRowChecksums implements RowChecksums {
    private final RowBasedChecksum[] checksums;

    private SparkRowChecksums(RowBasedChecksum[] checksums) {
        this.checksums = checksums;
    }

    /** The dependency's checksums, or null when it carries none (not a SQL shuffle, or turned off). */
    static RowChecksums of(ShuffleDependency<?, ?, ?> dependency) {
        RowBasedChecksum[] checksums = dependency.rowBasedChecksums();
        return checksums == null || checksums.length == 0 ? null : new SparkRowChecksums(checksums);
    }

    @Override
    public void update(int partition, Object key, Object value) {
        checksums[partition].update(key, value);
    }

    @Override
    public long value() {
        return RowBasedChecksum.getAggregatedChecksumValue(checksums);
    }
}

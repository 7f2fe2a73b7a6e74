package io.tern.spark;

/**
 * Spark's order-independent checksums of one map task's output, one per reduce partition (Spark
 * 4.1 and later, {@code ShuffleDependency.rowBasedChecksums}, which SQL fills when
 * {@code spark.sql.shuffle.orderIndependentChecksum.enabled}, the default from 4.2). The driver
 * compares a rerun map's checksum with the first run's to find nondeterministic recomputation and
 * then retries the consumer stages. These checksum records, not bytes, so Tern's crc32c of its
 * batches (which guards the bytes end to end) cannot stand in: the writer feeds every record it
 * writes here and reports {@link #value()} in its MapStatus, as Spark's own writers do.
 * {@link SparkLine#rowChecksums} gives none where the running Spark asks for none.
 */
interface RowChecksums {
    /** One record written to reduce partition {@code partition}. */
    void update(int partition, Object key, Object value);

    /** The map output's checksum, aggregated over its partitions as Spark aggregates them. */
    long value();
}

package io.tern.spark.tools;

import java.util.Random;
import java.util.zip.CRC32;

import org.apache.spark.HashPartitioner;
import org.apache.spark.api.java.JavaSparkContext;

import scala.Tuple2;

/**
 * Shuffle-heavy queries for the storage-pressure tests: each shuffles {@code records} records of
 * {@code recordBytes} random (incompressible) bytes into {@code partitions} partitions and returns
 * the sum of their CRC32s and keys, which {@link #expected} computes without Spark. Everything a
 * query builds is local to the call, so once it returns, its shuffle is garbage on the driver, as
 * a finished query's is in a long application.
 */
public final class PressureJobs {
    private PressureJobs() {}

    private static long record(long seed, long i, byte[] into) {
        new Random(seed * 1_000_003L + i).nextBytes(into);
        CRC32 crc = new CRC32();
        crc.update(into, 0, into.length);
        return crc.getValue() + i;
    }

    /** Shuffles query {@code seed}'s records and returns their checksum, computed after the shuffle. */
    public static long shuffle(JavaSparkContext jsc, long seed, long records, int recordBytes, int partitions) {
        long perPartition = (records + partitions - 1) / partitions;
        return jsc.parallelize(java.util.Arrays.asList(new Integer[partitions]), partitions)
                .mapPartitionsWithIndex((index, ignored) -> {
                    long start = index * perPartition;
                    long end = Math.min(records, start + perPartition);
                    return new java.util.Iterator<Tuple2<Long, byte[]>>() {
                        long i = start;

                        @Override
                        public boolean hasNext() {
                            return i < end;
                        }

                        @Override
                        public Tuple2<Long, byte[]> next() {
                            byte[] bytes = new byte[recordBytes];
                            new Random(seed * 1_000_003L + i).nextBytes(bytes);
                            return new Tuple2<>(i++, bytes);
                        }
                    };
                }, false)
                .mapToPair(t -> t)
                .partitionBy(new HashPartitioner(partitions))
                .map(t -> {
                    CRC32 crc = new CRC32();
                    crc.update(t._2(), 0, t._2().length);
                    return crc.getValue() + t._1();
                })
                .reduce(Long::sum);
    }

    /** What {@link #shuffle} returns for the same arguments. */
    public static long expected(long seed, long records, int recordBytes) {
        byte[] bytes = new byte[recordBytes];
        long sum = 0;
        for (long i = 0; i < records; i++) {
            sum += record(seed, i, bytes);
        }
        return sum;
    }
}

package io.tern.spark;

/**
 * Tern had no room for a push ("out-of-space"): every tier the shuffle's storage class allows is
 * full on the servers tried. Thrown by the native writer after its bounded wait for space
 * ({@code spark.tern.spaceWait}); the message names the segment, its server and the full tiers.
 */
public class TernOutOfSpaceException extends TernException {
    private static final long serialVersionUID = 1L;

    public TernOutOfSpaceException(String kind, String message) {
        super(kind, message);
    }
}

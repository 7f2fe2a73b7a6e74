package io.tern.spark;

import java.io.Serializable;

import org.apache.spark.rpc.RpcCallContext;
import org.apache.spark.rpc.RpcEndpoint;
import org.apache.spark.rpc.RpcEnv;

import scala.Function1;
import scala.PartialFunction;
import scala.runtime.AbstractPartialFunction;
import scala.runtime.BoxedUnit;

/**
 * The driver's RPC endpoint ({@value #NAME}).
 *
 * <p>Lost data: an executor's reader that found data lost in Tern has the driver unregister every
 * lost map output of that shuffle at once, before the reader throws its FetchFailedException. The
 * DAGScheduler's one resubmission of the map stage then recomputes exactly the lost maps; without
 * it each failing reducer names one map, and a server holding data of many maps needs as many
 * stage attempts as it takes to name them all.
 *
 * <p>Space: an executor whose push waits for space says so ({@link SpaceShort}, one-way), and the
 * driver has Spark free the shuffles nothing references ({@link TernCleaner}); a map task whose
 * wait ran out has the driver cancel its stage with a message saying what is full and what to do
 * ({@link SpaceExhausted}), so Spark does not run the task three more times into the same wall.
 */
final class TernDriverEndpoint implements RpcEndpoint {
    static final String NAME = "tern-shuffle";

    /** Asks the driver to unregister the lost maps of a Spark shuffle; the reply is their indexes (int[]). */
    static final class UnregisterLostMaps implements Serializable {
        private static final long serialVersionUID = 1L;
        final int shuffleId;

        UnregisterLostMaps(int shuffleId) {
            this.shuffleId = shuffleId;
        }
    }

    /** A push on an executor waits for space (one-way): the refusal, naming what is full. */
    static final class SpaceShort implements Serializable {
        private static final long serialVersionUID = 1L;
        final String refusal;

        SpaceShort(String refusal) {
            this.refusal = refusal;
        }
    }

    /** A map task of {@code stageId} found no space within its wait; the reply is the message it fails with. */
    static final class SpaceExhausted implements Serializable {
        private static final long serialVersionUID = 1L;
        final int stageId;
        final String refusal;

        SpaceExhausted(int stageId, String refusal) {
            this.stageId = stageId;
            this.refusal = refusal;
        }
    }

    private final RpcEnv rpcEnv;
    private final TernShuffleManager manager;

    TernDriverEndpoint(RpcEnv rpcEnv, TernShuffleManager manager) {
        this.rpcEnv = rpcEnv;
        this.manager = manager;
    }

    @Override
    public RpcEnv rpcEnv() {
        return rpcEnv;
    }

    @Override
    public PartialFunction<Object, BoxedUnit> receiveAndReply(RpcCallContext context) {
        return new AbstractPartialFunction<Object, BoxedUnit>() {
            @Override
            public boolean isDefinedAt(Object message) {
                return message instanceof UnregisterLostMaps || message instanceof SpaceExhausted;
            }

            @Override
            @SuppressWarnings("unchecked")
            public <A1, B1> B1 applyOrElse(A1 message, Function1<A1, B1> otherwise) {
                try {
                    if (message instanceof UnregisterLostMaps) {
                        context.reply(manager.unregisterLostMaps(((UnregisterLostMaps) message).shuffleId));
                    } else if (message instanceof SpaceExhausted) {
                        SpaceExhausted exhausted = (SpaceExhausted) message;
                        context.reply(manager.failStageForSpace(exhausted.stageId, exhausted.refusal));
                    } else {
                        return otherwise.apply(message);
                    }
                } catch (RuntimeException e) {
                    context.sendFailure(e);
                }
                return (B1) BoxedUnit.UNIT;
            }
        };
    }

    @Override
    public PartialFunction<Object, BoxedUnit> receive() {
        return new AbstractPartialFunction<Object, BoxedUnit>() {
            @Override
            public boolean isDefinedAt(Object message) {
                return message instanceof SpaceShort;
            }

            @Override
            @SuppressWarnings("unchecked")
            public <A1, B1> B1 applyOrElse(A1 message, Function1<A1, B1> otherwise) {
                if (!(message instanceof SpaceShort)) {
                    return otherwise.apply(message);
                }
                manager.freeUnreferencedShuffles(((SpaceShort) message).refusal);
                return (B1) BoxedUnit.UNIT;
            }
        };
    }
}

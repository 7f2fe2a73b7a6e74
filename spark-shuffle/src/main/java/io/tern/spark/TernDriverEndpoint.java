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
 * The driver's RPC endpoint ({@value #NAME}) through which an executor's reader that found data
 * lost in Tern has the driver unregister every lost map output of that shuffle at once, before the
 * reader throws its FetchFailedException. The DAGScheduler's one resubmission of the map stage
 * then recomputes exactly the lost maps; without it each failing reducer names one map, and a
 * server holding data of many maps needs as many stage attempts as it takes to name them all.
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
                return message instanceof UnregisterLostMaps;
            }

            @Override
            @SuppressWarnings("unchecked")
            public <A1, B1> B1 applyOrElse(A1 message, Function1<A1, B1> otherwise) {
                if (!(message instanceof UnregisterLostMaps)) {
                    return otherwise.apply(message);
                }
                try {
                    context.reply(manager.unregisterLostMaps(((UnregisterLostMaps) message).shuffleId));
                } catch (RuntimeException e) {
                    context.sendFailure(e);
                }
                return (B1) BoxedUnit.UNIT;
            }
        };
    }
}

"""A three-broker KRaft Kafka for the chaos suite, beside the local stack's one-node broker: every node
is broker and controller (a static quorum of three), every topic has replication factor 3 and
``min.insync.replicas`` 2, so a record a producer was told is written (``acks=all``) survives the loss
of any one broker. The fault kills the broker that leads a partition (kill -9) and brings it back on its
ports with its data, as a crashed pod comes back.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmbatch.stack.kafka_broker import LOG4J, kafka_cluster_id, kafka_libs, kafka_ready
from llmbatch.stack.ports import free_port
from llmbatch.stack.process import alive, run_checked, spawn, stop_tree, wait_until

JAVA_OPTS = ["-Xms128m", "-Xmx384m", "-XX:+UseG1GC", "-Djava.awt.headless=true"]


@dataclass
class KafkaNode:
    node_id: int
    port: int
    controller: int
    data: Path
    log: Path
    pid: int = 0


class KafkaCluster:
    """``size`` brokers on 127.0.0.1 and free ports, data and logs under ``run_dir``; stopped by PID."""

    def __init__(self, run_dir: Path, size: int = 3) -> None:
        self.run_dir = run_dir
        self.nodes = [
            KafkaNode(
                i,
                free_port(),
                free_port(),
                run_dir / f"kafka-{i}",
                run_dir / "logs" / f"kafka-{i}.log",
            )
            for i in range(1, size + 1)
        ]

    @property
    def bootstrap_servers(self) -> str:
        return ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def start(self, within: float = 180.0) -> None:
        """Format every node's storage with one cluster id, start them all, wait until each answers."""
        cluster = kafka_cluster_id()
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        for node in self.nodes:
            node.data.mkdir(parents=True, exist_ok=True)
            props = self._properties(node)
            run_checked(
                ["java", *JAVA_OPTS, "-cp", f"{kafka_libs()}/*", "kafka.tools.StorageTool", "format",
                 "-t", cluster, "-c", str(props)],
                f"formatting Kafka node {node.node_id}",
            )  # fmt: skip
        for node in self.nodes:
            self._spawn(node)
        for node in self.nodes:
            self._wait(node, within)

    def restart(self, node: KafkaNode, within: float = 180.0) -> None:
        """Start ``node`` again on its ports with its data."""
        self._spawn(node)
        self._wait(node, within)

    def node(self, node_id: int) -> KafkaNode:
        return next(n for n in self.nodes if n.node_id == node_id)

    async def leader_of(self, topic: str, partition: int = 0) -> KafkaNode | None:
        """The node that leads ``topic``'s ``partition`` now (None: no leader or no answer)."""
        from aiokafka.admin import AIOKafkaAdminClient

        admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap_servers, request_timeout_ms=5000)
        try:
            await admin.start()
            described: Any = await admin.describe_topics([topic])
        except Exception:
            return None
        finally:
            with contextlib.suppress(Exception):
                await admin.close()
        for info in described or []:
            for p in info.get("partitions") or []:
                if p.get("partition") == partition and p.get("leader", -1) >= 0:
                    with contextlib.suppress(StopIteration):
                        return self.node(int(p["leader"]))
        return None

    def alive(self) -> list[int]:
        return [n.node_id for n in self.nodes if n.pid and alive(n.pid)]

    def stop(self) -> None:
        for node in self.nodes:
            if node.pid and alive(node.pid):
                stop_tree(node.pid)

    def _wait(self, node: KafkaNode, within: float) -> None:
        wait_until(lambda: kafka_ready(node.port), within, node.pid, f"Kafka {node.node_id}", node.log)

    def _spawn(self, node: KafkaNode) -> None:
        argv = ["java", *JAVA_OPTS, f"-Dlog4j2.configurationFile={LOG4J}", "-cp", f"{kafka_libs()}/*"]
        node.pid = spawn([*argv, "kafka.Kafka", str(node.data / "server.properties")], node.log)

    def _properties(self, node: KafkaNode) -> Path:
        voters = ",".join(f"{n.node_id}@127.0.0.1:{n.controller}" for n in self.nodes)
        lines = [
            "process.roles=broker,controller",
            f"node.id={node.node_id}",
            f"controller.quorum.voters={voters}",
            f"listeners=PLAINTEXT://127.0.0.1:{node.port},CONTROLLER://127.0.0.1:{node.controller}",
            f"advertised.listeners=PLAINTEXT://127.0.0.1:{node.port}",
            "inter.broker.listener.name=PLAINTEXT",
            "listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
            "controller.listener.names=CONTROLLER",
            f"log.dirs={node.data / 'logs'}",
            "num.partitions=3",
            f"default.replication.factor={len(self.nodes)}",
            "min.insync.replicas=2",
            f"offsets.topic.replication.factor={len(self.nodes)}",
            "offsets.topic.num.partitions=6",
            f"transaction.state.log.replication.factor={len(self.nodes)}",
            "transaction.state.log.min.isr=2",
            f"share.coordinator.state.topic.replication.factor={len(self.nodes)}",
            "share.coordinator.state.topic.min.isr=2",
            "group.initial.rebalance.delay.ms=0",
            "auto.create.topics.enable=false",
            "unclean.leader.election.enable=false",
            "",
        ]
        props = node.data / "server.properties"
        props.write_text("\n".join(lines))
        return props

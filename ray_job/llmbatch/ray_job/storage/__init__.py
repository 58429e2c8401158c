"""Where the job side keeps things: S3 objects (the node's keys or an attempt's own session) and Redis
(the client and every key name), and the node's secrets both are reached with."""

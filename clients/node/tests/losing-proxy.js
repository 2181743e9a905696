'use strict';
// A TCP proxy in front of the server (or the pooler) that loses the answer to one statement: the
// first statement whose text contains `marker` runs and commits, then the connection breaks
// before its answer reaches the client, as a dropped server connection, a pooler or a network
// failure can do. Every other connection and statement passes through unchanged.

const net = require('node:net');
const path = require('node:path');

// ReadyForQuery: the server has finished the statement (and committed its implicit transaction).
const READY = Buffer.from([0x5a, 0, 0, 0, 5]);

class LosingProxy {
  // target: pg connection settings ({ host, port }); a host that is a directory is a Unix socket.
  constructor(target, marker) {
    this.target = target.host.startsWith('/')
      ? { path: path.join(target.host, `.s.PGSQL.${target.port}`) }
      : { host: target.host, port: target.port };
    this.marker = Buffer.from(marker);
    this.armed = true;
    this.cut = 0; // connections broken so far (at most one)
    this.seen = 0; // statements with the marker sent through the proxy
    this.sockets = new Set();
  }

  async start() {
    this.server = net.createServer((client) => this.relay(client));
    await new Promise((resolve) => this.server.listen(0, '127.0.0.1', resolve));
    this.port = this.server.address().port;
    return this;
  }

  relay(client) {
    const server = net.connect(this.target);
    for (const s of [client, server]) {
      this.sockets.add(s);
      s.on('close', () => this.sockets.delete(s));
      s.on('error', () => {});
    }
    let doomed = false;
    let held = Buffer.alloc(0);
    client.on('data', (d) => {
      if (d.includes(this.marker)) {
        this.seen += 1;
        if (this.armed) {
          this.armed = false;
          doomed = true;
        }
      }
      server.write(d);
    });
    server.on('data', (d) => {
      if (!doomed) {
        client.write(d);
        return;
      }
      // Swallow the answer; once the server is done with the statement, break the connection.
      held = Buffer.concat([held, d]);
      if (held.includes(READY)) {
        this.cut += 1;
        client.destroy();
        server.destroy();
      }
    });
    client.on('close', () => server.destroy());
    server.on('close', () => client.destroy());
  }

  // Connection settings for pg through the proxy.
  config(extra = {}) {
    return { host: '127.0.0.1', port: this.port, ...extra };
  }

  async close() {
    for (const s of this.sockets) s.destroy();
    await new Promise((resolve) => this.server.close(resolve));
  }
}

module.exports = { LosingProxy };

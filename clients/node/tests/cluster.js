'use strict';
// A throwaway PostgreSQL cluster for the tests, like tests/integration/cluster.py: initdb into a
// fresh directory under /tmp, a Unix socket there, a free port, trust authentication, the
// extension created in database `idem`. initdb refuses root: as root, the server's commands run
// as the postgres OS user (runuser). PG_BIN chooses the server (default PostgreSQL 15 of Debian);
// the extension must be installed into it.

const { execFileSync } = require('node:child_process');
const fs = require('node:fs');
const net = require('node:net');
const os = require('node:os');
const path = require('node:path');
const { Pool } = require('pg');

const PG_BIN = process.env.PG_BIN || '/usr/lib/postgresql/15/bin';

function asPostgres(cmd, args) {
  const root = process.getuid && process.getuid() === 0;
  const [file, argv] = root ? ['runuser', ['-u', 'postgres', '--', cmd, ...args]] : [cmd, args];
  return execFileSync(file, argv, { stdio: ['ignore', 'pipe', 'pipe'] });
}

function freePort() {
  return new Promise((resolve, reject) => {
    const s = net.createServer();
    s.listen(0, '127.0.0.1', () => {
      const { port } = s.address();
      s.close(() => resolve(port));
    });
    s.on('error', reject);
  });
}

class Cluster {
  async start() {
    this.dir = fs.mkdtempSync(path.join(os.tmpdir(), 'pg-idempotency-node-'));
    fs.chmodSync(this.dir, 0o777);
    this.data = path.join(this.dir, 'data');
    this.log = path.join(this.dir, 'server.log');
    this.port = await freePort();
    this.database = 'idem';
    asPostgres(`${PG_BIN}/initdb`, ['-D', this.data, '-A', 'trust', '-U', 'postgres', '--no-sync', '-E', 'UTF8', '--locale=C.UTF-8']);
    fs.appendFileSync(path.join(this.data, 'postgresql.auto.conf'), [
      "listen_addresses = ''", `unix_socket_directories = '${this.dir}'`, `port = ${this.port}`,
      'max_connections = 100', 'fsync = off', "log_min_messages = 'warning'", '',
    ].join('\n'));
    this.pgCtl('start', '-w', '-l', this.log);
    execFileSync(`${PG_BIN}/createdb`, ['-h', this.dir, '-p', String(this.port), '-U', 'postgres', this.database]);
    const pool = this.pool();
    await pool.query('CREATE EXTENSION idempotency');
    await pool.end();
    return this;
  }

  pgCtl(...args) {
    asPostgres(`${PG_BIN}/pg_ctl`, ['-D', this.data, ...args]);
  }

  // Connection settings for pg, and as PG* environment variables for child processes.
  config() {
    return { host: this.dir, port: this.port, user: 'postgres', database: this.database };
  }

  env() {
    return { ...process.env, PGHOST: this.dir, PGPORT: String(this.port), PGUSER: 'postgres', PGDATABASE: this.database };
  }

  url() {
    return `postgresql://postgres@localhost:${this.port}/${this.database}?host=${encodeURIComponent(this.dir)}`;
  }

  pool(extra = {}) {
    const pool = new Pool({ ...this.config(), max: 20, ...extra });
    pool.on('error', () => {}); // idle connections dropped by a restart
    return pool;
  }

  stop(mode = 'fast') {
    this.pgCtl('stop', '-m', mode, '-w');
  }

  restart() {
    this.pgCtl('start', '-w', '-t', '60', '-l', this.log);
  }

  destroy() {
    if (!this.dir) return;
    try {
      this.stop('immediate');
    } catch {
      // not running
    }
    fs.rmSync(this.dir, { recursive: true, force: true });
    this.dir = null;
  }
}

// A test process that is stopped (or ends without its after hook) leaves no server running.
const live = new Set();
process.on('exit', () => { for (const c of live) c.destroy(); });
for (const signal of ['SIGINT', 'SIGTERM']) process.once(signal, () => process.exit(130));

async function startCluster() {
  const c = new Cluster();
  live.add(c);
  return c.start();
}

module.exports = { startCluster, Cluster, PG_BIN };

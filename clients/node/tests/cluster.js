'use strict';
// A throwaway PostgreSQL cluster for the tests, like tests/integration/cluster.py: initdb into a
// fresh directory under /tmp, a Unix socket there, a free port, trust authentication, the
// extension created in database `idem`. initdb refuses root: as root, the server's commands run
// as the postgres OS user (runuser). PG_BIN chooses the server (default PostgreSQL 15 of Debian);
// the extension must be installed into it.
//
// IDEMPOTENCY_TEST_POOLER (`direct`, the default, `transaction` or `session`) puts PgBouncer in
// that pool mode between the tests' connections and the cluster, as production often runs it
// (like tests/integration/pooler.py): config(), pool(), url() and env() then lead through the
// pooler, while directConfig() and directPool() reach the server itself (for what must see or
// kill a server connection).
//
// IDEMPOTENCY_TEST_CONNINFO (a postgresql:// URL) targets an existing server with the extension
// installed instead: each test file gets a fresh database there (dropped at the end), made by
// the URL's role, which must be allowed to create databases and the extension; the role `app` of
// some tests is created there as well and connects the way that role does (without a password).
// The tests that stop and restart the server are skipped.

const { execFileSync, spawn } = require('node:child_process');
const fs = require('node:fs');
const net = require('node:net');
const os = require('node:os');
const path = require('node:path');
const { Pool, Client } = require('pg');

const PG_BIN = process.env.PG_BIN || '/usr/lib/postgresql/15/bin';
const PGBOUNCER = process.env.PGBOUNCER || '/usr/sbin/pgbouncer';
const POOLER_MODES = ['direct', 'transaction', 'session'];
const POOLER = process.env.IDEMPOTENCY_TEST_POOLER || 'direct';
const CONNINFO = process.env.IDEMPOTENCY_TEST_CONNINFO || null;
// Why a test that stops the server is skipped, or false.
const NO_RESTART = CONNINFO ? 'the tests do not stop a server they did not start (IDEMPOTENCY_TEST_CONNINFO)' : false;
if (!POOLER_MODES.includes(POOLER)) {
  throw new Error(`IDEMPOTENCY_TEST_POOLER must be one of ${POOLER_MODES.join(', ')}, not '${POOLER}'`);
}
// PgBouncer lets in (auth_type = trust) only the roles of its user list: every role a test
// connects as through it.
const POOLER_USERS = ['postgres', 'app'];

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

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

// PgBouncer in `mode` in front of a cluster's socket: its own port, ini and user list in a
// directory of its own, run as the postgres OS user (it refuses root).
class PgBouncer {
  constructor(cluster, mode) {
    this.cluster = cluster;
    this.mode = mode;
    // Session mode holds a server connection per client connection (the tests' pools keep idle
    // ones for 10 s): enough for every pool of a test file at once; transaction mode shares them.
    this.poolSize = mode === 'session' ? 150 : 40;
  }

  async start() {
    this.dir = fs.mkdtempSync(path.join(os.tmpdir(), 'pg-idempotency-pgbouncer-'));
    fs.chmodSync(this.dir, 0o777);
    this.port = await freePort();
    this.ini = path.join(this.dir, 'pgbouncer.ini');
    this.log = path.join(this.dir, 'pgbouncer.log');
    const server = this.cluster.directConfig();
    // The password of the server's role (an existing server's), with which PgBouncer logs in.
    const users = [...new Set([...POOLER_USERS, server.user])];
    fs.writeFileSync(path.join(this.dir, 'userlist.txt'),
      users.map((u) => `"${u}" "${u === server.user ? server.password ?? '' : ''}"\n`).join(''));
    fs.writeFileSync(this.ini, `[databases]
* = host=${server.host} port=${server.port}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = ${this.port}
unix_socket_dir = ${this.dir}
auth_type = trust
auth_file = ${this.dir}/userlist.txt
admin_users = postgres
pool_mode = ${this.mode}
default_pool_size = ${this.poolSize}
max_client_conn = 1000
logfile = ${this.log}
pidfile = ${this.dir}/pgbouncer.pid
ignore_startup_parameters = extra_float_digits
server_reset_query = DISCARD ALL
server_check_delay = 0
server_login_retry = 1
`);
    for (const name of fs.readdirSync(this.dir)) fs.chmodSync(path.join(this.dir, name), 0o666);
    const root = process.getuid && process.getuid() === 0;
    const [file, argv] = root ? ['runuser', ['-u', 'postgres', '--', PGBOUNCER, this.ini]] : [PGBOUNCER, [this.ini]];
    this.proc = spawn(file, argv, { stdio: ['ignore', 'ignore', 'pipe'] });
    let stderr = '';
    this.proc.stderr.on('data', (d) => { stderr += d; });
    const deadline = Date.now() + 15000;
    for (;;) {
      const client = new Client({ ...this.config(), connectionTimeoutMillis: 2000 });
      try {
        await client.connect();
        await client.query('SELECT 1');
        await client.end();
        return this;
      } catch (err) {
        await client.end().catch(() => {});
        if (this.proc.exitCode !== null || Date.now() > deadline) {
          throw new Error(`pgbouncer did not start: ${err.message}\n${stderr.slice(-2000)}\n${this.readLog().slice(-2000)}`);
        }
        await sleep(100);
      }
    }
  }

  config() {
    return { host: '127.0.0.1', port: this.port, user: this.cluster.directConfig().user, database: this.cluster.database };
  }

  readLog() {
    try {
      return fs.readFileSync(this.log, 'utf8');
    } catch {
      return '';
    }
  }

  // Synchronous, for the process' exit hook: SIGINT is PgBouncer's immediate shutdown, sent to
  // the pid it wrote (under runuser, the spawned process is runuser's).
  stop() {
    if (!this.dir) return;
    try {
      process.kill(Number(fs.readFileSync(path.join(this.dir, 'pgbouncer.pid'), 'utf8')), 'SIGINT');
    } catch {
      // not running
    }
    fs.rmSync(this.dir, { recursive: true, force: true });
    this.dir = null;
  }
}

class Cluster {
  async start() {
    this.dir = fs.mkdtempSync(path.join(os.tmpdir(), 'pg-idempotency-node-'));
    fs.chmodSync(this.dir, 0o777);
    if (CONNINFO) return this.startOn(CONNINFO);
    this.data = path.join(this.dir, 'data');
    this.log = path.join(this.dir, 'server.log');
    this.port = await freePort();
    this.database = 'idem';
    asPostgres(`${PG_BIN}/initdb`, ['-D', this.data, '-A', 'trust', '-U', 'postgres', '--no-sync', '-E', 'UTF8', '--locale=C.UTF-8']);
    fs.appendFileSync(path.join(this.data, 'postgresql.auto.conf'), [
      "listen_addresses = ''", `unix_socket_directories = '${this.dir}'`, `port = ${this.port}`,
      'max_connections = 200', 'fsync = off', "log_min_messages = 'warning'", '',
    ].join('\n'));
    this.pgCtl('start', '-w', '-l', this.log);
    execFileSync(`${PG_BIN}/createdb`, ['-h', this.dir, '-p', String(this.port), '-U', 'postgres', this.database]);
    const pool = this.pool();
    await pool.query('CREATE EXTENSION idempotency');
    await pool.end();
    this.pooler = POOLER === 'direct' ? null : await new PgBouncer(this, POOLER).start();
    return this;
  }

  // A fresh database on an existing server.
  async startOn(conninfo) {
    const { parse } = require('pg-connection-string');
    const c = parse(conninfo);
    this.server = {
      host: c.host || '/var/run/postgresql', port: Number(c.port || 5432), user: c.user || os.userInfo().username,
      ...(c.password ? { password: c.password } : {}),
    };
    this.database = `idem_node_${process.pid}_${Date.now() % 100000}`;
    this.adminDatabase = c.database || 'postgres';
    const admin = new Client({ ...this.server, database: this.adminDatabase });
    await admin.connect();
    try {
      await admin.query(`CREATE DATABASE ${this.database}`);
    } finally {
      await admin.end();
    }
    this.external = true;
    const pool = this.directPool();
    await pool.query('CREATE EXTENSION idempotency');
    await pool.end();
    this.pooler = POOLER === 'direct' ? null : await new PgBouncer(this, POOLER).start();
    return this;
  }

  pgCtl(...args) {
    if (this.external) throw new Error(NO_RESTART);
    asPostgres(`${PG_BIN}/pg_ctl`, ['-D', this.data, ...args]);
  }

  // Connection settings for pg (through the pooler, if any), and as PG* environment variables
  // for child processes.
  config() {
    return this.pooler ? this.pooler.config() : this.directConfig();
  }

  // The server itself, never through the pooler.
  directConfig() {
    if (this.external) return { ...this.server, database: this.database };
    return { host: this.dir, port: this.port, user: 'postgres', database: this.database };
  }

  env() {
    const c = this.config();
    return {
      ...process.env, PGHOST: c.host, PGPORT: String(c.port), PGUSER: c.user, PGDATABASE: this.database,
      ...(c.password ? { PGPASSWORD: c.password } : {}),
    };
  }

  url() {
    const c = this.config();
    const user = encodeURIComponent(c.user) + (c.password ? `:${encodeURIComponent(c.password)}` : '');
    return `postgresql://${user}@localhost:${c.port}/${this.database}?host=${encodeURIComponent(c.host)}`;
  }

  pool(extra = {}) {
    const pool = new Pool({ ...this.config(), max: 20, ...extra });
    pool.on('error', () => {}); // idle connections dropped by a restart
    return pool;
  }

  directPool(extra = {}) {
    return this.pool({ ...this.directConfig(), ...extra });
  }

  stop(mode = 'fast') {
    this.pgCtl('stop', '-m', mode, '-w');
  }

  restart() {
    this.pgCtl('start', '-w', '-t', '60', '-l', this.log);
  }

  destroy() {
    if (this.pooler) this.pooler.stop();
    if (!this.dir) return;
    if (this.external) {
      // Synchronous, as the process' exit hook needs: a child process drops the database.
      const drop = `const { Client } = require('pg'); const c = new Client(JSON.parse(process.argv[1]));
        c.connect().then(() => c.query('DROP DATABASE IF EXISTS ${this.database} WITH (FORCE)')).finally(() => c.end());`;
      try {
        execFileSync(process.execPath, ['-e', drop, JSON.stringify({ ...this.server, database: this.adminDatabase })],
          { cwd: path.join(__dirname, '..'), stdio: 'ignore', timeout: 30000 });
      } catch {
        // left for the server's owner
      }
    } else {
      try {
        this.stop('immediate');
      } catch {
        // not running
      }
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

module.exports = { startCluster, Cluster, PG_BIN, POOLER, NO_RESTART };

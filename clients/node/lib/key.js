'use strict';
// The Idempotency-Key request header. The IETF draft declares it a Structured Field Item whose
// value is a String (RFC 9651 sf-string: "...", printable ASCII, \" and \\ escapes). The value is
// parsed as RFC 9651 parses an Item: a String, optionally followed by parameters ("abc";p=1),
// which are checked and ignored. An Item of another type (a bare token abc, an integer 1, a
// boolean ?1, ...) does not match the declared type, which makes the field malformed: it is
// refused, never taken as a key, so that abc and "abc" are never two spellings of one key. The
// key itself then follows the extension's rule: 1 to 255 characters. (The same rules as
// examples/http-service/src/key.rs.)

const MAX_KEY_CHARS = 255;

class KeyError extends Error {
  constructor(kind, detail) {
    super(detail);
    this.kind = kind; // 'missing' or 'malformed'
  }
}

const EXAMPLE = 'Idempotency-Key: "8e03978e-40d5-43e8-bc93-6894a57f9324"';

function itemKind(c) {
  if (c === '-' || (c >= '0' && c <= '9')) return 'an Integer or Decimal';
  if (c === '*' || /[A-Za-z]/.test(c)) return 'a bare Token';
  return {
    ':': 'a Byte Sequence', '?': 'a Boolean', '@': 'a Date', '%': 'a Display String', '(': 'an Inner List',
  }[c] ?? 'not a structured-field Item';
}

const isTchar = (c) => /[A-Za-z0-9!#$%&'*+\-.^_`|~]/.test(c);
const hex = (c) => '0123456789abcdef'.indexOf(c);

function malformed(detail) {
  return new KeyError('malformed', detail);
}

class Parser {
  constructor(v) {
    this.v = v;
    this.i = 0;
  }

  peek() {
    return this.i < this.v.length ? this.v[this.i] : undefined;
  }

  skipSp() {
    while (this.peek() === ' ') this.i += 1;
  }

  badParam(why, pos = this.i + 1) {
    return malformed(`Idempotency-Key has a malformed parameter at position ${pos}: ${why}`);
  }

  // RFC 9651 4.2.5; the opening quote is at this.i.
  string() {
    let out = '';
    this.i += 1;
    while (this.i < this.v.length) {
      const c = this.v[this.i];
      const code = c.charCodeAt(0);
      if (c === '\\') {
        const e = this.v[this.i + 1];
        if (e !== '"' && e !== '\\') {
          throw malformed(`Idempotency-Key has a bad escape at position ${this.i + 1}: only \\" and \\\\ may follow a backslash`);
        }
        out += e;
        this.i += 2;
      } else if (c === '"') {
        this.i += 1;
        return out;
      } else if (code >= 0x20 && code <= 0x7e) {
        out += c;
        this.i += 1;
      } else {
        throw malformed(`Idempotency-Key has a bad character at position ${this.i + 1} (byte 0x${code.toString(16).padStart(2, '0')}): a String may hold printable ASCII only`);
      }
    }
    throw malformed('Idempotency-Key starts with \'"\' but has no closing quote');
  }

  // RFC 9651 4.2.3.2: *( ";" *SP key [ "=" bare-item ] )
  parameters() {
    while (this.peek() === ';') {
      this.i += 1;
      this.skipSp();
      const c = this.peek();
      if (c === undefined || !/[a-z*]/.test(c)) throw this.badParam("a parameter name starts with a lower-case letter or '*'");
      this.i += 1;
      while (this.peek() !== undefined && /[a-z0-9_\-.*]/.test(this.peek())) this.i += 1;
      if (this.peek() === '=') {
        this.i += 1;
        const start = this.i;
        try {
          this.bareItem();
        } catch (err) {
          if (err instanceof KeyError && err.param) throw this.badParam(err.param, start + 1);
          throw err;
        }
      }
    }
  }

  bareItem() {
    const fail = (why) => Object.assign(malformed(why), { param: why });
    const c = this.peek();
    if (c === '-' || (c >= '0' && c <= '9')) return this.number(false, fail);
    if (c === '"') {
      try {
        this.string();
      } catch {
        throw fail('a String value is printable ASCII in double quotes');
      }
      return undefined;
    }
    if (c !== undefined && (c === '*' || /[A-Za-z]/.test(c))) {
      this.i += 1;
      while (this.peek() !== undefined && (isTchar(this.peek()) || this.peek() === ':' || this.peek() === '/')) this.i += 1;
      return undefined;
    }
    if (c === ':') {
      this.i += 1;
      while (this.peek() !== undefined && /[A-Za-z0-9+/=]/.test(this.peek())) this.i += 1;
      if (this.peek() !== ':') throw fail("a Byte Sequence holds base64 and ends with ':'");
      this.i += 1;
      return undefined;
    }
    if (c === '?') {
      const b = this.v[this.i + 1];
      if (b !== '0' && b !== '1') throw fail('a Boolean is ?0 or ?1');
      this.i += 2;
      return undefined;
    }
    if (c === '@') {
      this.i += 1;
      return this.number(true, fail);
    }
    if (c === '%') return this.displayString(fail);
    throw fail("a value follows '='");
  }

  // RFC 9651 4.2.4: an Integer (at most 15 digits) or a Decimal (at most 12 digits, '.', 1 to 3
  // digits); a Date takes an Integer only.
  number(integerOnly, fail) {
    if (this.peek() === '-') this.i += 1;
    const digits = () => {
      const start = this.i;
      while (this.peek() !== undefined && this.peek() >= '0' && this.peek() <= '9') this.i += 1;
      return this.i - start;
    };
    const intDigits = digits();
    if (intDigits === 0) throw fail('a number has a digit here');
    if (this.peek() === '.' && integerOnly) throw fail("a Date is an Integer, with no '.'");
    if (this.peek() !== '.') {
      if (intDigits > 15) throw fail('an Integer has at most 15 digits');
      return undefined;
    }
    if (intDigits > 12) throw fail("a Decimal has at most 12 digits before the '.'");
    this.i += 1;
    const frac = digits();
    if (frac < 1 || frac > 3) throw fail("a Decimal has 1 to 3 digits after the '.'");
    return undefined;
  }

  // RFC 9651 4.2.10: %"...", printable ASCII and %xx (lower-case hex) escapes of UTF-8.
  displayString(fail) {
    this.i += 1;
    if (this.peek() !== '"') throw fail('a Display String starts with %"');
    this.i += 1;
    const bytes = [];
    while (this.i < this.v.length) {
      const c = this.v[this.i];
      const code = c.charCodeAt(0);
      if (c === '%') {
        const hi = hex(this.v[this.i + 1] ?? 'x');
        const lo = hex(this.v[this.i + 2] ?? 'x');
        if (hi < 0 || lo < 0) throw fail("'%' in a Display String takes two lower-case hex digits");
        bytes.push(hi * 16 + lo);
        this.i += 3;
      } else if (c === '"') {
        try {
          new TextDecoder('utf-8', { fatal: true }).decode(Uint8Array.from(bytes));
        } catch {
          throw fail('a Display String decodes to UTF-8');
        }
        this.i += 1;
        return undefined;
      } else if (code >= 0x20 && code <= 0x7e) {
        bytes.push(code);
        this.i += 1;
      } else {
        throw fail('a Display String holds printable ASCII');
      }
    }
    throw fail('a Display String ends with \'"\'');
  }
}

// Parses one field value (a string; header values are latin1 in Node). Returns the key or
// throws a KeyError whose message is the problem detail. Positions are 1-based.
// lenient: a bare key (`Idempotency-Key: 8e03978e-...`, as Stripe-style clients send it) is
// accepted as the key too: 1 to 255 printable ASCII characters without space, '"', ',' or '\'.
const BARE = /^[\x21\x23-\x2b\x2d-\x5b\x5d-\x7e]+$/;

function parseValue(v, lenient = false) {
  const p = new Parser(v);
  p.skipSp();
  const c = p.peek();
  if (lenient && c !== undefined && c !== '"') {
    const bare = v.replace(/^[ \t]+|[ \t]+$/g, '');
    if (BARE.test(bare)) {
      if (bare.length > MAX_KEY_CHARS) {
        throw malformed(`Idempotency-Key is too long: ${bare.length} characters, at most ${MAX_KEY_CHARS} are allowed`);
      }
      return bare;
    }
  }
  if (c === undefined) throw malformed('Idempotency-Key is empty; it must have 1 to 255 characters');
  if (c !== '"') {
    throw malformed(`Idempotency-Key is ${itemKind(c)}, not a String: the key must be a structured-field String (RFC 9651) in double quotes, e.g. ${EXAMPLE}`);
  }
  const key = p.string();
  p.parameters();
  p.skipSp();
  if (p.i !== v.length) {
    throw malformed(`Idempotency-Key has characters after the closing quote at position ${p.i + 1}: only parameters (;name or ;name=value) may follow the String`);
  }
  if (key.length === 0) throw malformed('Idempotency-Key is empty; it must have 1 to 255 characters');
  if (key.length > MAX_KEY_CHARS) {
    throw malformed(`Idempotency-Key is too long: ${key.length} characters, at most ${MAX_KEY_CHARS} are allowed`);
  }
  return key;
}

// values: every Idempotency-Key field line of the request (req.headersDistinct['idempotency-key']).
function parseHeader(values, lenient = false) {
  if (values === undefined || values.length === 0) {
    throw new KeyError('missing', `This operation requires an Idempotency-Key header, e.g. ${EXAMPLE}`);
  }
  if (values.length > 1) throw malformed('Idempotency-Key was sent more than once; send exactly one');
  return parseValue(values[0], lenient);
}

// Writes s as an RFC 9651 sf-string (for a key sent on to another service).
function sfString(s) {
  return `"${s.replace(/["\\]/g, (c) => `\\${c}`)}"`;
}

module.exports = { parseValue, parseHeader, sfString, KeyError, MAX_KEY_CHARS };

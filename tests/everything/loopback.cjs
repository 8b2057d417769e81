// Preload (node --require) that pins every net/http server that does not name a
// host to 127.0.0.1. The everything server calls app.listen(PORT) with no host,
// which Node binds to the unspecified address (:: / 0.0.0.0, all interfaces),
// and it reads no HOST variable; this keeps the test upstream on loopback.
// Override with EVERYTHING_HOST (e.g. ::1) if needed.
"use strict";
const net = require("node:net");
const HOST = process.env.EVERYTHING_HOST || "127.0.0.1";
const listen = net.Server.prototype.listen;
net.Server.prototype.listen = function (...args) {
  const first = args[0];
  if (first !== null && typeof first === "object" && !Array.isArray(first)) {
    if (first.path === undefined && first.host === undefined && first.fd === undefined && !first._handle) {
      args[0] = { ...first, host: HOST };
    }
  } else if (typeof first === "number" || (typeof first === "string" && /^\d+$/.test(first))) {
    if (typeof args[1] !== "string") {
      args.splice(1, 0, HOST);
    }
  } else if (first === undefined || typeof first === "function") {
    args.unshift(0, HOST);
    if (first === undefined) args.splice(2, 1);
  }
  return listen.apply(this, args);
};

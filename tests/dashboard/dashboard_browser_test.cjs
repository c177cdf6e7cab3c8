// The dashboard in a real browser (Debian's chromium, headless, driven by puppeteer-core) against
// a running local job of 4 workers. Checks, in order:
//   1. the page loads nothing from anywhere but the coordinator (every other request is refused
//      and counted);
//   2. it shows 4 workers, all ALIVE, and a falling loss;
//   3. a policy change from the form with a wrong token, then with none, is refused on the page
//      and `hsdpctl policy get` still shows version 1;
//   4. with the control token the change is accepted; the page names the step it applies from,
//      `hsdpctl policy get` shows it, the sealed schedule of that step carries it
//      (`hsdpctl schedule --step N`) while the step before keeps the old policy, and the page
//      shows the new version and the units' new reshard flags;
//   5. steps traced with `hsdpctl trace` appear on the page's timeline: every rank, the same
//      spans as the trace file hsdpctl wrote.
// Screenshots of each stage go to --artifacts.
//
//   node dashboard_browser_test.cjs --url URL --chromium PATH --hsdpctl PATH
//        --coordinator HOST:PORT --token-file PATH --artifacts DIR
'use strict';

const assert = require('node:assert/strict');
const {execFileSync} = require('node:child_process');
const fs = require('node:fs');
const os = require('node:os');
const path = require('node:path');
const puppeteer = require('puppeteer-core');

const WORKERS = 4;
const MIN_LOSS_POINTS = 20;
const WAIT_MS = 90_000;

function parseArgs(argv) {
  const args = {};
  for (let i = 0; i < argv.length; i += 2) {
    if (!argv[i].startsWith('--') || i + 1 >= argv.length) {
      throw new Error(`bad argument ${argv[i]}`);
    }
    args[argv[i].slice(2)] = argv[i + 1];
  }
  for (const k of ['url', 'chromium', 'hsdpctl', 'coordinator', 'token-file', 'artifacts']) {
    if (!args[k]) throw new Error(`--${k} is required`);
  }
  return args;
}

const args = parseArgs(process.argv.slice(2));
const started = Date.now();
function log(message) {
  console.log(`[${((Date.now() - started) / 1000).toFixed(1)}s] ${message}`);
}

function hsdpctl(...command) {
  const out = execFileSync(args.hsdpctl, ['--coordinator', args.coordinator, '--token-file',
                                          args['token-file'], '--json', ...command],
                           {encoding: 'utf8'});
  return JSON.parse(out);
}

async function sleep(ms) { return new Promise((resolve) => setTimeout(resolve, ms)); }

async function until(what, fn, timeoutMs = WAIT_MS) {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    const value = await fn();
    if (value) return value;
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`);
    await sleep(250);
  }
}

async function screenshot(page, name) {
  const file = path.join(args.artifacts, name);
  await page.screenshot({path: file, fullPage: true});
  log(`screenshot ${file}`);
}

async function fillPolicyForm(page, {units, reshardAfterForward, token}) {
  await page.select('#policy-form select[name="reshard_after_forward"]', reshardAfterForward);
  const unitsInput = await page.$('#policy-form input[name="units"]');
  await unitsInput.click({clickCount: 3});
  await unitsInput.press('Backspace');
  await unitsInput.type(units);
  const tokenInput = await page.$('#policy-form input[name="token"]');
  await tokenInput.click({clickCount: 3});
  await tokenInput.press('Backspace');
  if (token) await tokenInput.type(token);
}

// Submits the form and returns the result line once it changed.
async function submitPolicy(page) {
  await page.$eval('#policy-result', (el) => { el.textContent = ''; el.className = ''; });
  await page.click('#policy-form button[type="submit"]');
  await page.waitForFunction(
      () => document.querySelector('#policy-result').textContent !== '', {timeout: WAIT_MS});
  return page.$eval('#policy-result', (el) => ({text: el.textContent, cls: el.className}));
}

async function main() {
  fs.mkdirSync(args.artifacts, {recursive: true});
  const profile = fs.mkdtempSync(path.join(os.tmpdir(), 'hsdp-chromium-'));
  const browser = await puppeteer.launch({
    executablePath: args.chromium,
    headless: true,
    userDataDir: profile,
    args: ['--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
           '--disable-background-networking', '--disable-component-update', '--disable-sync'],
    defaultViewport: {width: 1400, height: 1000},
  });
  try {
    const page = await browser.newPage();
    const origin = new URL(args.url).origin;
    const foreign = [];
    const pageErrors = [];
    page.on('pageerror', (e) => pageErrors.push(String(e)));
    await page.setRequestInterception(true);
    page.on('request', (request) => {
      const url = request.url();
      if (url.startsWith(origin + '/') || url.startsWith('data:')) {
        request.continue();
      } else {
        foreign.push(url);
        request.abort();
      }
    });

    // 1 + 2: the job as the page shows it.
    await page.goto(args.url, {waitUntil: 'load'});
    log(`loaded ${args.url}`);
    await page.waitForFunction(
        (n) => {
          const rows = [...document.querySelectorAll('#workers tbody tr')];
          return rows.length === n && rows.every((r) => r.cells[1].textContent === 'ALIVE');
        },
        {timeout: WAIT_MS}, WORKERS);
    log(`${WORKERS} workers ALIVE on the page`);
    await page.waitForFunction(
        (n) => Number(document.querySelector('#loss-chart').dataset.points || 0) >= n,
        {timeout: WAIT_MS}, MIN_LOSS_POINTS);
    const loss = await page.$eval('#loss-summary', (el) => el.textContent);
    const m = /^([\d.]+) at step (\d+) → ([\d.]+) at step (\d+)$/.exec(loss);
    assert.ok(m, `loss summary "${loss}"`);
    const [first, last] = [Number(m[1]), Number(m[3])];
    assert.ok(last < first, `loss does not fall: ${loss}`);
    assert.equal(await page.$eval('#job-state', (el) => el.textContent), 'RUNNING');
    assert.equal(await page.$eval('#workers-alive', (el) => el.textContent), `${WORKERS} / ${WORKERS}`);
    log(`loss falls: ${loss}`);
    await screenshot(page, 'dashboard-running.png');

    // 3: refused without the right token, and nothing changed.
    const before = hsdpctl('policy', 'get');
    assert.equal(Number(before.policy_version), 1);
    for (const token of ['wrong-token', '']) {
      await fillPolicyForm(page, {units: 'layers.*', reshardAfterForward: 'false', token});
      const refused = await submitPolicy(page);
      assert.equal(refused.cls, 'error', JSON.stringify(refused));
      assert.match(refused.text, /^refused: UNAUTHENTICATED: /);
      log(`token "${token}": ${refused.text}`);
      if (token !== '') await screenshot(page, 'dashboard-wrong-token.png');
    }
    const after = hsdpctl('policy', 'get');
    assert.deepEqual(after, before, 'a refused change changed the policy');
    log('hsdpctl policy get: unchanged (version 1)');

    // 4: accepted with the token, lands as `hsdpctl policy set` would.
    const token = fs.readFileSync(args['token-file'], 'utf8').trim();
    await fillPolicyForm(page, {units: 'layers.*', reshardAfterForward: 'false', token});
    const accepted = await submitPolicy(page);
    assert.equal(accepted.cls, 'ok', JSON.stringify(accepted));
    const am = /^policy version (\d+) applies from step (\d+)$/.exec(accepted.text);
    assert.ok(am, accepted.text);
    const [version, step] = [Number(am[1]), Number(am[2])];
    assert.equal(version, 2);
    log(`page: ${accepted.text}`);

    const now = hsdpctl('policy', 'get');
    assert.equal(Number(now.policy_version), 2);
    assert.equal(Number(now.effective_step), step);
    assert.deepEqual(now.policy.overrides,
                     [{unit_glob: 'layers.*', reshard_after_forward: false}]);
    log(`hsdpctl policy get: version 2 from step ${step}, override layers.* raf=false`);

    await until(`step ${step} sealed`,
                () => Number(hsdpctl('status').sealed_step) >= step);
    const sealed = hsdpctl('schedule', '--step', String(step)).schedule;
    assert.equal(Number(sealed.policy_version), 2);
    // The root is never resharded after forward (backward needs it at once), whatever the
    // policy; every other unit follows it.
    const blocks = (units) => units.filter((u) => u.unit_name !== 'root');
    for (const u of sealed.units) {
      assert.equal(u.reshard_after_forward,
                   u.unit_name !== 'root' && !u.unit_name.startsWith('layers.'),
                   `step ${step} unit ${u.unit_name}`);
    }
    if (step > 0) {
      const previous = hsdpctl('schedule', '--step', String(step - 1)).schedule;
      assert.equal(Number(previous.policy_version), 1);
      assert.ok(blocks(previous.units).every((u) => u.reshard_after_forward),
                `step ${step - 1} changed`);
    }
    log(`hsdpctl schedule: step ${step} sealed with version 2 (layers.* keep their ` +
        `parameters after forward), step ${step - 1} with version 1`);

    await page.waitForFunction(
        () => document.querySelector('#policy-version').textContent === '2' &&
              [...document.querySelectorAll('#units tbody tr')]
                  .filter((r) => r.cells[0].textContent.startsWith('layers.'))
                  .every((r) => r.cells[4].textContent === 'no / yes'),
        {timeout: WAIT_MS});
    // Let the loss chart run past the change so its mark shows.
    await until('steps past the change', () => page.$eval(
        '#loss-summary', (el, s) => Number((/at step (\d+)$/.exec(el.textContent) || [])[1]) > s + 10,
        step));
    log('page: policy version 2, layers.* reshard fwd/bwd "no / yes"');
    await screenshot(page, 'dashboard-policy-changed.png');

    // 5: steps traced with `hsdpctl trace` show on the page's timeline, every rank of them.
    const traceFile = path.join(args.artifacts, 'trace.json');
    let summary = null;
    for (let attempt = 0; summary === null; ++attempt) {
      // A few steps ahead of the sealed one; the job may seal past them before the request
      // lands (FAILED_PRECONDITION), then ask again further ahead.
      const first = Number(hsdpctl('status').sealed_step) + 3;
      try {
        summary = hsdpctl('trace', '--steps', `${first}..${first + 1}`, '-o', traceFile,
                          '--wait', '60');
      } catch (e) {
        if (attempt >= 4) throw e;
      }
    }
    assert.equal(summary.complete, true, JSON.stringify(summary));
    const traced = JSON.parse(fs.readFileSync(traceFile, 'utf8'));
    const tracedSpans = traced.traceEvents.filter((e) => e.ph === 'X').length;
    assert.ok(tracedSpans > 0, 'the trace has no spans');
    await page.waitForFunction(
        (n, spans) => {
          const chart = document.querySelector('#timeline-chart');
          return Number(chart.dataset.ranks || 0) === n && Number(chart.dataset.spans) === spans;
        },
        {timeout: WAIT_MS}, WORKERS, tracedSpans);
    const range = await page.$eval('#timeline-range', (el) => el.textContent);
    assert.match(range, new RegExp(`^steps ${traced.otherData.first_step}\\.\\.` +
                                   `${traced.otherData.last_step} · ${WORKERS} ranks`));
    log(`page timeline: ${range}; ${tracedSpans} spans, as in hsdpctl's trace.json`);
    const timeline = await page.$('#timeline');
    await timeline.screenshot({path: path.join(args.artifacts, 'dashboard-timeline.png')});
    log(`screenshot ${path.join(args.artifacts, 'dashboard-timeline.png')}`);

    assert.deepEqual(foreign, [], 'the page requested other origins');
    assert.deepEqual(pageErrors, [], 'the page threw');
    log('no request left the coordinator, no script error');
  } finally {
    await browser.close();
    fs.rmSync(profile, {recursive: true, force: true});
  }
}

main().then(() => log('PASS'), (e) => {
  console.error(`FAIL: ${e.stack || e}`);
  process.exit(1);
});

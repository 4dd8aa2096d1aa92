/**
 * The status-bar item: the current notebook's mesh in one line; a click opens the panel.
 */
import { Widget } from '@lumino/widgets';

import { IMeshSummary } from './channel';
import { CurrentMesh } from './current';

/** The parts of the status line: [text, class] (a class marks what needs attention). */
export function statusParts(s: IMeshSummary): [string, string][] {
  const parts: [string, string][] = [[`mesh ${s.shape}`, 'mnb-lab-shape']];
  if (s.state !== 'ok') {
    parts.push([s.state, s.state === 'shut down' ? '' : 'mnb-lab-bad']);
  }
  if (s.state !== 'shut down') {
    parts.push([`${s.alive}/${s.total} alive`, s.alive < s.total ? 'mnb-lab-bad' : '']);
    parts.push([
      s.busy.length > 4 && s.busy_ranks
        ? `busy ${s.busy_ranks}`
        : s.busy.length
          ? `busy ${s.busy.map(r => 'r' + r).join(',')}`
          : 'idle',
      s.busy.length ? 'mnb-lab-busy' : ''
    ]);
  }
  if (s.paused) {
    parts.push([`${s.paused} paused`, 'mnb-lab-paused']);
  }
  if (s.errors) {
    parts.push([`${s.errors} error${s.errors === 1 ? '' : 's'}`, 'mnb-lab-bad']);
  }
  if (s.auto !== undefined && s.auto !== null) {
    parts.push(['auto', 'mnb-lab-auto']);
  }
  return parts;
}

/** A tooltip with what the line leaves out. */
export function statusTitle(s: IMeshSummary): string {
  const lines = [`monarch_nb mesh '${s.name}' (${s.shape}, ${s.backend}): ${s.state}`];
  const dead = Object.entries(s.dead);
  if (dead.length > 4 && s.dead_folded) {
    for (const [why, ranks] of Object.entries(s.dead_folded)) {
      lines.push(`${ranks}: ${why}`);
    }
  } else {
    for (const [rank, why] of dead) {
      lines.push(`rank ${rank}: ${why}`);
    }
  }
  if (s.queued) {
    lines.push(`${s.queued} command(s) queued`);
  }
  for (const session of s.sessions) {
    lines.push(`paused: ${session.label}`);
  }
  if (s.auto !== undefined && s.auto !== null) {
    const args = s.auto ? ` ${s.auto}` : '';
    lines.push(`auto mode: every cell runs as %%monarch${args} (%monarch_auto off)`);
  }
  lines.push('click: open the monarch_nb panel');
  return lines.join('\n');
}

export class MeshStatusItem extends Widget {
  constructor(private _current: CurrentMesh, onClick: () => void) {
    super();
    this.addClass('mnb-lab-status');
    this.node.setAttribute('role', 'button');
    this.node.addEventListener('click', onClick);
    _current.changed.connect(this._draw, this);
    this._draw();
  }

  private _draw(): void {
    const s = this._current.summary;
    this.node.replaceChildren();
    if (s === null) {
      this.node.title = '';
      return;
    }
    this.node.title = statusTitle(s);
    this.node.dataset.alive = String(s.alive);
    this.node.dataset.total = String(s.total);
    statusParts(s).forEach(([text, cls], i) => {
      if (i > 0) {
        this.node.appendChild(document.createTextNode(' · '));
      }
      const span = document.createElement('span');
      span.textContent = text;
      if (cls) {
        span.className = cls;
      }
      this.node.appendChild(span);
    });
  }
}

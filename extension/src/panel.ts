/**
 * The side panel: the dashboard of the current notebook's mesh (the kernel's
 * ipywidgets Dashboard, drawn by that notebook's widget manager) above the
 * debugger console.
 */
import { NotebookPanel } from '@jupyterlab/notebook';
import { MimeModel } from '@jupyterlab/rendermime';
import { Message } from '@lumino/messaging';
import { Panel, Widget } from '@lumino/widgets';

import { MeshChannel } from './channel';
import { DebuggerConsole } from './console';
import { CurrentMesh } from './current';

const WIDGET_MIME = 'application/vnd.jupyter.widget-view+json';

export class MeshPanel extends Panel {
  constructor(private _current: CurrentMesh) {
    super();
    this.id = 'monarch-nb-panel';
    this.addClass('mnb-lab-panel');
    this._head.addClass('mnb-lab-head');
    this._dash.addClass('mnb-lab-dash');
    this.addWidget(this._head);
    this.addWidget(this._dash);
    this.addWidget(this._console);
    _current.changed.connect(this._update, this);
    this._update();
  }

  protected onAfterShow(msg: Message): void {
    super.onAfterShow(msg);
    this._update();
  }

  private _update(): void {
    const panel = this._current.panel;
    const channel = this._current.channel;
    const s = channel?.summary ?? null;
    this._console.bind(channel);
    const name = panel?.context.path ?? '';
    let head: string;
    if (panel === null) {
      head = 'Open a notebook: this panel shows the monarch_nb mesh of its kernel.';
    } else if (channel === null || !channel.connected) {
      head = `${name}: monarch_nb is not loaded in this kernel (%load_ext monarch_nb).`;
    } else if (s === null) {
      head = `${name}: no mesh yet (%monarch_mesh dp=2 makes one).`;
    } else {
      head = `${name}: mesh '${s.name}' ${s.shape} (${s.backend})`;
    }
    this._head.node.textContent = head;
    // the dashboard is drawn only while the panel shows, and asked for again when
    // the notebook, its kernel or its mesh changes (a stale view goes at once)
    const key =
      panel !== null && channel !== null && s !== null ? `${name}\n${channel.epoch}\n${s.id}` : '';
    if (key === this._shown) {
      return;
    }
    if (!this.isVisible) {
      if (this._shown) {
        this._clear();
        this._shown = '';
      }
      return;
    }
    this._shown = key;
    this._clear();
    if (key && channel !== null && panel !== null) {
      void this._render(panel, channel, key);
    }
  }

  private _clear(): void {
    this._renderer?.dispose();
    this._renderer = null;
  }

  private async _render(panel: NotebookPanel, channel: MeshChannel, key: string): Promise<void> {
    let reply: any;
    try {
      reply = await channel.request('dashboard');
    } catch (e) {
      this._note(`the dashboard did not come: ${(e as Error).message}`, key);
      return;
    }
    if (key !== this._shown) {
      return; // the panel moved on meanwhile
    }
    if (!reply.model_id) {
      this._note(reply.error ?? 'no mesh', key);
      return;
    }
    const rendermime = panel.content.rendermime;
    if (rendermime.preferredMimeType({ [WIDGET_MIME]: {} }, 'any') !== WIDGET_MIME) {
      this._note('ipywidgets is not enabled in this JupyterLab: no dashboard', key);
      return;
    }
    const renderer = rendermime.createRenderer(WIDGET_MIME);
    const model = new MimeModel({
      data: { [WIDGET_MIME]: { model_id: reply.model_id, version_major: 2, version_minor: 1 } }
    });
    this._clear();
    this._renderer = renderer;
    this._dash.addWidget(renderer);
    await renderer.renderModel(model);
  }

  private _note(text: string, key: string): void {
    if (key !== this._shown) {
      return;
    }
    this._clear();
    const w = new Widget();
    w.addClass('mnb-lab-note');
    w.node.textContent = text;
    this._renderer = w;
    this._dash.addWidget(w);
  }

  private _head = new Widget();
  private _dash = new Panel();
  private _console = new DebuggerConsole();
  private _renderer: Widget | null = null;
  private _shown = '';
}
